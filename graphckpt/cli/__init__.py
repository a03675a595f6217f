"""The `graphckpt` command line: inspect, measure, demo.

    graphckpt inspect MODEL.keras [--segments auto|sqrt|N] [--budget B] [--open-layers] [--attention-chunks K]
                                  [--batch-size N] [--input-shape [NAME=]8,512 ...]
                                  [--format table|json|dot] [--wide]
    graphckpt measure MODEL.keras --batch-size N | --input-shape ... [--segments ...]
                                  [--budget ...] [--steps N] [--repeats N] [--json PATH]
    graphckpt demo [--depth N] [--width N] [--batch-size N] ...

docs/cli.md describes every command and flag, with real output.

`main(argv) -> int` is the whole program; `python -m graphckpt` and the
console script call it. Inspection builds plain data (`describe`), and the
renderers only print it. Errors print one line and exit non-zero (2: a bad
argument; 1: anything else); `--debug` prints the traceback too.
"""

import argparse
import sys
import traceback
import warnings

# Only cheap imports here: `--help`, `--version` and argument errors must not
# wait for TensorFlow. Keras comes in through `startup.import_keras`.
from graphckpt.cli.args import (
    CliError,
    budget_arg,
    in_flags,
    parse_input_shapes,
    parse_segments,
    positive_int,
)
from graphckpt.cli.commands import DEMO, cmd_demo, cmd_inspect, cmd_measure, demo_model
from graphckpt.cli.loading import load_model_file
from graphckpt.cli.report import describe
from graphckpt.cli.startup import quiet_tensorflow
from graphckpt.errors import GraphckptError, GraphckptWarning, InvalidArgumentError

__all__ = ["main", "describe", "budget_arg", "parse_input_shapes", "demo_model", "load_model_file"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise CliError(f"{message} (see `{self.prog} --help`)", code=2)


def _parser():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="on error, print the full traceback")
    planning = argparse.ArgumentParser(add_help=False)
    planning.add_argument(
        "--segments",
        metavar="auto|sqrt|N",
        help="number of segments: 'auto' (default: the least estimated peak, recomputing least), 'sqrt' or an integer",
    )
    planning.add_argument(
        "--budget", metavar="B", help="memory budget: bytes with a unit (2GiB, 800MB), or a fraction of the baseline (0.3)"
    )
    planning.add_argument(
        "--open-layers",
        action="store_true",
        help="also cut inside composite layers (transformer blocks, MultiHeadAttention, keras_hub encoders)",
    )
    planning.add_argument(
        "--attention-chunks",
        type=positive_int,
        metavar="K",
        help="run each MultiHeadAttention core in K chunks of its (example, head) pairs, each recomputed (attention_chunks=K)",
    )
    loading = argparse.ArgumentParser(add_help=False)
    loading.add_argument("model", metavar="MODEL.keras", help="a model saved with model.save('....keras')")
    loading.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE first (it registers the model's custom classes); repeatable",
    )
    loading.add_argument(
        "--input-shape",
        dest="input_shape",
        action="append",
        metavar="[NAME=]8,512",
        help="the shape of an input, batch dimension first (e.g. 8,512 for token ids of shape (None, None)); "
        "repeat it for several inputs, in order, or name them (token_ids=8,512)",
    )

    parser = _Parser(prog="graphckpt", description="Gradient checkpointing for Keras 3 functional models.", parents=[common])
    parser.add_argument("--version", action="version", version=f"graphckpt {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("inspect", parents=[common, loading, planning], help="show the plan for a saved model")
    p.add_argument("--batch-size", type=positive_int, metavar="N", help="bytes for a batch of N (default: per example)")
    p.add_argument("--format", choices=("table", "json", "dot"), default="table", help="output format (default: table)")
    p.add_argument("--wide", action="store_true", help="table: full layer paths inside nested models (they wrap)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("measure", parents=[common, loading, planning], help="measure peak memory, baseline vs plan")
    p.add_argument(
        "--batch-size", type=positive_int, metavar="N", help="examples per training step (or the first dim of --input-shape)"
    )
    p.add_argument("--steps", type=positive_int, default=5, metavar="N", help="measured training steps (default: 5)")
    p.add_argument("--repeats", type=positive_int, default=3, metavar="N", help="alternate N baseline/graphckpt pairs, report medians and spread (default: 3)")
    p.add_argument("--json", metavar="PATH", help="also write the measurements as JSON to PATH")
    p.set_defaults(func=cmd_measure)

    p = sub.add_parser("demo", parents=[common, planning], help="plan and measure a built-in deep Dense chain")
    p.add_argument("--depth", type=positive_int, default=DEMO["depth"], metavar="N", help=f"Dense layers (default: {DEMO['depth']})")
    p.add_argument("--width", type=positive_int, default=DEMO["width"], metavar="N", help=f"units per layer (default: {DEMO['width']})")
    p.add_argument("--batch-size", type=positive_int, default=DEMO["batch_size"], metavar="N", help=f"default: {DEMO['batch_size']}")
    p.add_argument("--steps", type=positive_int, default=5, metavar="N", help="measured training steps (default: 5)")
    p.add_argument("--repeats", type=positive_int, default=3, metavar="N", help="alternate N baseline/graphckpt pairs, report medians and spread (default: 3)")
    p.set_defaults(func=cmd_demo)
    return parser


def _version():
    try:
        from importlib.metadata import version

        return version("graphckpt")
    except Exception:
        return "unknown"


def _warning_printer(show_others):
    """graphckpt's own warnings as one line each, like its errors, in the
    command's words; any other library's as `show_others` shows them."""

    def show(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, GraphckptWarning):
            show_others(message, category, filename, lineno, file, line)
            return
        print(f"graphckpt: warning: {in_flags(' '.join(str(message).split()))}", file=sys.stderr)

    return show


def main(argv=None):
    """Runs the graphckpt command line. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    with warnings.catch_warnings(), quiet_tensorflow():
        if not debug:
            warnings.showwarning = _warning_printer(warnings.showwarning)
        return _main(argv, debug)


def _main(argv, debug):
    try:
        try:
            args = _parser().parse_args(argv)
        except SystemExit as e:  # --help and --version
            return e.code or 0
        args.debug = debug  # a subcommand's default would hide a leading --debug
        if args.command in ("inspect", "measure", "demo") and getattr(args, "segments", None) is not None:
            parse_segments(args.segments)  # bad values fail before any model loads
        parse_input_shapes(getattr(args, "input_shape", None))
        if getattr(args, "budget", None) is not None:
            budget_arg(args.budget)  # last: graphckpt.budget imports Keras
        return args.func(args)
    except KeyboardInterrupt:
        print("graphckpt: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            traceback.print_exc()
        if isinstance(e, CliError):
            code = e.code
        elif isinstance(e, GraphckptError):
            code = 2 if isinstance(e, InvalidArgumentError) else 1
        else:
            code = 1
        message = " ".join(str(e).split()) or type(e).__name__
        if not isinstance(e, GraphckptError):
            message = f"{type(e).__name__}: {message}"
        elif not isinstance(e, CliError):
            message = in_flags(message)  # the Python API's words, in flags
        print(f"graphckpt: error: {message}", file=sys.stderr)
        return code
