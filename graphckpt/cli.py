"""The `graphckpt` command line: inspect, measure, demo.

    graphckpt inspect MODEL.keras [--segments auto|sqrt|N] [--budget B]
                                  [--batch-size N] [--input-shape [NAME=]8,512 ...]
                                  [--format table|json|dot]
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
import ast
import contextlib
import importlib
import json
import os
import re
import shlex
import sys
import tempfile
import traceback
import warnings
import zipfile

# Only cheap imports up here: `--help`, `--version` and argument errors must
# not wait for TensorFlow. Keras comes in through `_import_keras`.
from graphckpt.errors import GraphckptError, InvalidArgumentError

__all__ = ["main", "describe", "budget_arg", "parse_input_shapes", "demo_model", "load_model_file"]

DEMO = {"depth": 36, "width": 256, "batch_size": 256}


class CliError(GraphckptError):
    """An error the CLI reports as one line. `code` is the exit status."""

    def __init__(self, message, code=1):
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise CliError(f"{message} (see `{self.prog} --help`)", code=2)


# ---------------------------------------------------------------- arguments


def parse_segments(text):
    """`"auto"`, `"sqrt"` or a positive int, from the command line."""
    if text in ("auto", "sqrt"):
        return text
    if re.fullmatch(r"[0-9]+", text or "") and int(text) >= 1:
        return int(text)
    raise CliError(
        f"--segments must be 'auto', 'sqrt' or a positive integer. Received: --segments {text!r}", code=2
    )


_SHAPE_RE = re.compile(r"^(?:([^=\s]+)=)?\s*((?:[0-9]+|None)(?:\s*,\s*(?:[0-9]+|None))*)\s*,?\s*$")


def parse_input_shapes(texts):
    """Repeated `--input-shape` values -> `input_shape=` for the planner.

    `8,512` is one shape (batch dimension first; `None` for a dimension
    `--batch-size` gives); several unnamed values are a list, in the
    model's input order; `NAME=8,512` values, a dict keyed by input name.
    The planner checks them against the model's inputs.
    """
    if not texts:
        return None
    parsed = []
    for text in texts:
        match = _SHAPE_RE.match(text)
        if match is None:
            raise CliError(
                f"--input-shape takes comma-separated dimensions, batch first, optionally after an "
                f"input name: e.g. --input-shape 8,512 or --input-shape token_ids=8,512. Received: "
                f"--input-shape {text!r}",
                code=2,
            )
        dims = tuple(None if d.strip() == "None" else int(d) for d in match.group(2).split(","))
        parsed.append((match.group(1), dims))
    names = [name for name, _ in parsed]
    if all(name is not None for name in names):
        if len(set(names)) != len(names):
            raise CliError(f"--input-shape names an input twice: {names}", code=2)
        return dict(parsed)
    if any(name is not None for name in names):
        raise CliError("--input-shape: name every input (NAME=8,512) or none of them (in the model's input order)", code=2)
    shapes = [dims for _, dims in parsed]
    return shapes[0] if len(shapes) == 1 else shapes


def budget_arg(text):
    """A --budget value for `graphckpt.plan`: a bare integer becomes an int
    of bytes, a bare decimal a float (a fraction of the baseline, such as
    `0.3`), anything else (`2GiB`, `800 MB`) stays a string.
    `graphckpt.budget.parse_budget` checks it."""
    _import_keras()  # graphckpt.budget imports the estimator, and so Keras
    from graphckpt.budget import parse_budget

    value = text.strip()
    if re.fullmatch(r"[0-9]+", value):
        value = int(value)
    elif re.fullmatch(r"[0-9]*\.[0-9]+", value):
        value = float(value)
    parse_budget(value)  # raises InvalidArgumentError, naming the accepted forms
    return value


def _planner_kwargs(args):
    """`graphckpt.plan` keywords from the command line."""
    kwargs = {}
    if args.segments is not None:
        kwargs["segments"] = parse_segments(args.segments)
    if args.budget is not None:
        kwargs["budget"] = budget_arg(args.budget)
    if getattr(args, "batch_size", None):
        kwargs["batch_size"] = args.batch_size
    input_shape = parse_input_shapes(getattr(args, "input_shape", None))
    if input_shape is not None:
        kwargs["input_shape"] = input_shape
    return kwargs


# ---------------------------------------------------------------- start-up

# TensorFlow's C++ log lines (`I0000 00:00:1796318968.351520   22727
# cudart_stub.cc:31] ...`), and the lines that go with them. Those written
# while TensorFlow is imported come before absl's log set-up and ignore
# TF_CPP_MIN_LOG_LEVEL, so the CLI drops them itself, at that same level.
_NATIVE_LOG = re.compile(r"^([IWEF])\d{4} \S+\s+\d+ [^\s\]]+:\d+\] ")
_NATIVE_PREAMBLE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_NATIVE_CONTINUED = "To enable the following instructions:"
_SEVERITY = {"I": 1, "W": 2, "E": 3}  # the TF_CPP_MIN_LOG_LEVEL that hides it; F: never


def _tf_log_level():
    """TF_CPP_MIN_LOG_LEVEL as an int (0 when unset or not a number)."""
    try:
        return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0


def native_log_filter(lines, level):
    """The lines of `lines` that TF_CPP_MIN_LOG_LEVEL=`level` would show:
    TensorFlow's C++ records below it go, with absl's preamble line and a
    record's known continuation lines; every other line stays."""
    kept, dropped = [], False
    for line in lines:
        match = _NATIVE_LOG.match(line)
        if match:
            dropped = level >= _SEVERITY.get(match.group(1), 99)
        elif line.startswith(_NATIVE_PREAMBLE):
            dropped = level >= 1
        elif not (dropped and line.startswith(_NATIVE_CONTINUED)):
            dropped = False
        if not dropped:
            kept.append(line)
    return kept


@contextlib.contextmanager
def _native_stderr_filtered(level):
    """Runs the body with file descriptor 2 going to a temporary file, then
    writes back what `native_log_filter` keeps. C++ code writes to the
    descriptor, not to `sys.stderr`."""
    if level < 1:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                captured.seek(0)
                text = captured.read().decode(errors="replace")
                kept = "".join(native_log_filter(text.splitlines(keepends=True), level))
                if kept:
                    os.write(2, kept.encode())
    finally:
        os.close(saved)


def _import_keras():
    """Keras, and graphckpt's API (which registers its classes with Keras),
    imported the first time without TensorFlow's start-up lines.

    Returns:
        The `keras` module.
    """
    import graphckpt

    if "keras" not in sys.modules:
        with _native_stderr_filtered(_tf_log_level()):
            import keras  # noqa: F401  (graphckpt's import hook loads its API)
    graphckpt._load_api()
    return sys.modules["keras"]


@contextlib.contextmanager
def _quiet_tensorflow():
    """TF_CPP_MIN_LOG_LEVEL=3 (errors and below hidden) for this command and
    the processes it starts, unless the user set it; restored afterwards."""
    if "TF_CPP_MIN_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    try:
        yield
    finally:
        os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)


# ---------------------------------------------------------------- loading


def load_model_file(path, imports=()):
    """Loads a `.keras` file after importing `imports` (modules that register
    custom classes). Also the recipe `measure` runs in its child process."""
    keras = _import_keras()
    for name in imports:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise CliError(f"--import {name}: {e}") from None
    return keras.saving.load_model(path)


def _gist(error, limit=400):
    """The gist of an error message: its first line, without the object
    config Keras appends, cut after a whole sentence (or word) so that it
    stays under about `limit` characters."""
    text = str(error).strip() or type(error).__name__
    text = text.splitlines()[0].split(" Full object config:")[0].strip()
    if len(text) <= limit:
        return text
    sentences = re.split(r"(?<=[.!?])\s+", text)
    kept = sentences[0]
    for sentence in sentences[1:]:
        if len(kept) + 1 + len(sentence) > limit:
            break
        kept += " " + sentence
    if len(kept) > limit:  # one long sentence: cut at a word
        kept = kept[:limit].rsplit(" ", 1)[0] + " ..."
    return kept


# Keras's messages when a file names a class nobody registered: the one case
# where importing the module that defines it (--import) helps.
_MISSING_CLASS = re.compile(r"Could not locate (class|function)|Could not deserialize|register_keras_serializable|custom_objects")
_MODEL_SUFFIXES = (".keras", ".h5", ".hdf5")


def _root_cause(error):
    """The exception at the bottom of `error`'s chain: Keras wraps the
    reason a nested layer did not load ("Could not locate class ...") in a
    generic "could not be deserialized properly"."""
    seen = {id(error)}
    while True:
        inner = error.__cause__ or error.__context__
        if inner is None or id(inner) in seen:
            return error
        seen.add(id(inner))
        error = inner


def _load_tip(path, error):
    """What to try when `path` did not load with `error`."""
    if not path.lower().endswith(_MODEL_SUFFIXES):
        return (
            "Tip: pass a model saved with `model.save('model.keras')` (a .keras file; legacy .h5 files load too)."
        )
    if _MISSING_CLASS.search(str(error)):
        return (
            "Tip: pass --import MODULE for each module that defines (and registers) the model's custom classes."
        )
    return "Tip: save the model with `model.save('model.keras')` and check that the file is complete."


def _load(path, imports, debug):
    """The model in `path`, or a `CliError` saying why not."""
    if not os.path.exists(path):
        raise CliError(f"no such file: {path}")
    if os.path.isdir(path):
        raise CliError(f"{path} is a directory, not a .keras model file")
    if path.endswith(".keras") and not zipfile.is_zipfile(path):
        raise CliError(f"{path} is not a Keras model file: a .keras file is a zip archive, and this one is not")
    keras = _import_keras()
    try:
        model = load_model_file(path, imports)
    except CliError:
        raise
    except Exception as e:
        if debug:
            traceback.print_exc()
        cause = _root_cause(e)
        gist = _gist(cause)
        stop = "" if gist.endswith((".", "!", "?", "...")) else "."
        raise CliError(
            f"could not load {path} as a Keras model. {type(cause).__name__}: {gist}{stop} {_load_tip(path, cause)}"
        ) from None
    if not isinstance(model, keras.Model):
        raise CliError(f"{path} holds a {type(model).__name__}, not a Keras model")
    return model


def _planned(model, planner_kwargs):
    """`(plain model, graph, plan)`: a checkpointed file keeps its own plan
    unless new planner arguments are given. The graph has the real shapes
    the plan is estimated for (`--input-shape`)."""
    import graphckpt
    from graphckpt import api
    from graphckpt.graph import build_graph
    from graphckpt.shapes import sized_graph

    if isinstance(model, graphckpt.CheckpointedModel):
        plain = graphckpt.uncheckpoint(model)
        if not {"segments", "budget"} & set(planner_kwargs):
            graph, _ = sized_graph(build_graph(plain), planner_kwargs.get("input_shape"), planner_kwargs.get("batch_size"))
            return plain, graph, model.plan
        model = plain
    _, graph, the_plan, unchanged = api._planned(model, **planner_kwargs)
    api._warn_unchanged(model, unchanged)
    return model, graph, the_plan


# ---------------------------------------------------------------- inspection data


def _tensor_name(key, names, graph):
    """A tensor by its producing call's name, with `[i]` when that call
    produces several tensors."""
    _, _, index = key
    producer = graph.graph["tensors"][key].producer
    n_out = sum(1 for info in graph.graph["tensors"].values() if info.producer == producer)
    return f"{names[producer]}[{index}]" if n_out > 1 else names[producer]


def _plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def segment_counts(plan):
    """`(segments, recomputed)`: how many segments `plan` has, and how many
    of them are recomputed in backward (the rest run inline, as they are;
    the auto and sqrt plans run their last segment inline). A checkpointed
    model has one `Segment` layer per recomputed segment."""
    recomputed = sum(bool(getattr(seg, "remat", True)) for seg in plan.segments)
    return len(plan.segments), recomputed


def segments_phrase(plan):
    """`'4 segments, 3 recomputed'`: how every command counts segments."""
    total, recomputed = segment_counts(plan)
    return f"{_plural(total, 'segment')}, {recomputed} recomputed"


def describe(model, graph, plan, batch_size=None):
    """Plain data about a plan: what `inspect` prints, and its JSON.

    Every layer of the model is named exactly once, by its path inside
    nested models (`resnet50v2/conv1_conv`; a nested model's second call
    is `name@1/...`): in `layers` of the first segment that calls it, or in
    `outside` (model inputs). `calls` lists each segment's layer calls; a
    path's k-th call (k > 0) is written `path#k`.
    """
    from graphckpt.estimate import estimate
    from graphckpt.graph import call_names

    names = call_names(graph)
    tensors = graph.graph["tensors"]
    memory = estimate(model, plan, batch_size=batch_size, graph=graph)
    batch = memory.batch_size or 1
    seen, segments = set(), []
    for seg, peak in zip(plan.segments, memory.segments):
        calls = [names[n] for n in seg.nodes]
        layers = [n[0] for n in seg.nodes if n[0] not in seen and not seen.add(n[0])]

        def boundary(keys):
            return [
                {
                    "tensor": _tensor_name(k, names, graph),
                    "shape": list(tensors[k].shape),
                    "dtype": tensors[k].dtype,
                    "bytes": tensors[k].nbytes * batch,
                }
                for k in keys
            ]

        segments.append(
            {
                "index": seg.index,
                "recomputed": bool(getattr(seg, "remat", True)),
                "first": calls[0],
                "last": calls[-1],
                "num_calls": len(calls),
                "calls": calls,
                "layers": layers,
                "inputs": boundary(seg.inputs),
                "boundary": boundary(seg.outputs),
                "kept_bytes": peak.held_bytes,
                "peak_bytes": peak.peak_bytes,
            }
        )
    outside = [n[0] for n, d in graph.nodes(data=True) if d["kind"] == "input" and n[0] not in seen]
    num_segments, num_recomputed = segment_counts(plan)
    return {
        "model": model.name,
        "num_layers": len(seen) + len(outside),
        "num_layer_calls": plan.num_layer_calls,
        "num_segments": num_segments,
        "num_recomputed": num_recomputed,
        "strategy": plan.strategy,
        "batch_size": memory.batch_size,
        "bytes_are": f"for a batch of {memory.batch_size}" if memory.batch_size else "per example",
        "segments": segments,
        "outside": outside,
        "totals": {
            "baseline_bytes": memory.baseline_peak_bytes,
            "plan_bytes": memory.peak_bytes,
            "ratio": memory.ratio,
            "recompute_fraction": memory.recompute_flops / memory.forward_flops if memory.forward_flops else 0.0,
            "unknown_layers": list(memory.unknown_layers),
            "estimate": "graphckpt.estimate: peak training-step activation memory, from static shapes",
        },
    }


def to_dot(info, graph):
    """A Graphviz description: one node per layer call, segments as clusters."""
    from graphckpt.graph import call_names

    names = call_names(graph)

    def node_id(key):
        return json.dumps(names[key])

    lines = [f"digraph {json.dumps(info['model'])} {{", "  rankdir=TB;", "  node [shape=box, fontsize=10];"]
    for name in info["outside"]:
        lines.append(f"  {json.dumps(name)} [shape=ellipse];")
    for seg in info["segments"]:
        style = "rounded" if seg["recomputed"] else "dashed"
        label = f"segment {seg['index']}" + ("" if seg["recomputed"] else " (not recomputed)")
        lines.append(f"  subgraph cluster_{seg['index']} {{")
        lines.append(f"    label={json.dumps(label)}; style={style};")
        lines.extend(f"    {json.dumps(call)};" for call in seg["calls"])
        lines.append("  }")
    for u, v, data in graph.edges(data=True):
        shapes = ", ".join(str(tuple(graph.graph["tensors"][t].shape)) for t in data["tensors"])
        lines.append(f"  {node_id(u)} -> {node_id(v)} [label={json.dumps(shapes)}, fontsize=8];")
    lines.append("}")
    return "\n".join(lines)


# ---------------------------------------------------------------- rendering


def _console(stderr=False):
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:  # piped or captured: no 80-column default
        console = Console(stderr=stderr, highlight=False, width=120)
    return console


def _bytes(n):
    from graphckpt.measure import format_bytes

    return format_bytes(n)


def _shape(shape):
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ")"


def render_table(info, console):
    from rich.table import Table

    segments = f"{_plural(info['num_segments'], 'segment')}, {info['num_recomputed']} recomputed"
    title = f"{info['model']}: {_plural(info['num_layer_calls'], 'layer call')} in {segments} ({info['strategy']})"
    table = Table(title=title, title_justify="left")
    for col, justify in [("seg", "right"), ("first", "left"), ("last", "left"), ("calls", "right")]:
        table.add_column(col, justify=justify)
    table.add_column("boundary tensors", justify="left")
    table.add_column("kept bytes", justify="right")
    table.add_column("peak in its backward", justify="right")
    for seg in info["segments"]:
        boundary = "\n".join(f"{b['tensor']} {_shape(b['shape'])}" for b in seg["boundary"]) or "-"
        index = str(seg["index"]) + ("" if seg["recomputed"] else "*")
        row = (seg["first"], seg["last"], str(seg["num_calls"]), boundary)
        table.add_row(index, *row, _bytes(seg["kept_bytes"]), _bytes(seg["peak_bytes"]))
    console.print(table)
    totals = info["totals"]
    ratio = f" (x{totals['ratio']:.2f})" if totals["ratio"] is not None else ""
    console.print(
        f"estimated peak training-step memory ({info['bytes_are']}): "
        f"baseline {_bytes(totals['baseline_bytes'])}, plan {_bytes(totals['plan_bytes'])}{ratio}"
    )
    console.print(f"recomputed in backward: {totals['recompute_fraction']:.0%} of the forward FLOPs")
    if totals["unknown_layers"]:
        console.print(f"estimated conservatively (unknown layers): {', '.join(totals['unknown_layers'])}")
    if any(not s["recomputed"] for s in info["segments"]):
        console.print("* runs inline, not recomputed: its layer calls run as they are and keep what they keep")


def render_comparison(comparison, console, plan=None):
    """Medians over the repeats, and the median paired ratios. With the
    `plan` measured, the segments column counts its segments as `inspect`
    does; the number recomputed is always the measured model's."""
    import statistics

    from rich.table import Table

    first = comparison.baseline[0]
    repeats = len(comparison.baseline)
    title = f"measured: batch {first.batch_size}, {_plural(first.steps, 'step')}" + (f" x {repeats} runs" if repeats > 1 else "")
    table = Table(title=f"{title}, {first.device}", title_justify="left")
    for col in ("model", "peak training-step memory", "step time", "segments"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for label, runs in (("baseline", comparison.baseline), ("graphckpt", comparison.candidate)):
        peak = statistics.median(m.peak_bytes for m in runs)
        step = statistics.median(m.step_time_s for m in runs)
        table.add_row(label, _bytes(int(peak)), f"{step * 1000:.1f} ms", _segments_cell(label, runs[0], plan))
    console.print(table)
    peak, time_ = comparison.peak_ratio, comparison.time_ratio
    change = f"{abs(1 - peak) * 100:.0f}% {'less' if peak <= 1 else 'more'}"
    console.print(f"graphckpt / baseline: peak memory x{peak:.2f} ({change}), step time x{time_:.2f}")
    if repeats == 1:
        console.print("(one run each; step times on a busy machine are noisy: --repeats N alternates N pairs)")


def _segments_cell(label, measurement, plan):
    if label == "baseline":
        return "-"
    recomputed = measurement.num_segments or 0  # the measured model's Segment layers
    if plan is None:
        return f"{recomputed} recomputed"
    return f"{segment_counts(plan)[0]}, {recomputed} recomputed"


def plan_warning(plan, model_name):
    """Why `plan`, which recomputes, saves no memory by its own estimate, or None.

    A recomputed segment keeps its inputs and holds its whole interior
    again in its backward: a plan with few or short segments can need more
    memory than no plan at all.
    """
    _, recomputed = segment_counts(plan)
    peak, baseline = plan.estimated_peak_bytes, plan.baseline_peak_bytes
    if peak is None or baseline is None:
        return None
    if recomputed == 0:  # no checkpointing, no extra memory; the table says "0 recomputed"
        return None
    if peak >= baseline:
        change = "raises" if peak > baseline else "does not lower"
        more = f" ({peak - baseline:+,} bytes)" if _bytes(peak) == _bytes(baseline) and peak != baseline else ""
        return (
            f"the plan for model '{model_name}' ({segments_phrase(plan)}) {change} the estimated peak: "
            f"{_bytes(peak)}{more}, against {_bytes(baseline)} without checkpointing. A recomputed segment keeps "
            "its inputs and holds its interior again in its backward, so too few or too short segments cost "
            "memory. Tip: use the default, --segments auto, or a --budget."
        )
    return None


def _warn_if_no_saving(plan, model_name):
    message = plan_warning(plan, model_name)
    if message:
        warnings.warn(message, stacklevel=2)


# ---------------------------------------------------------------- commands


def _cmd_inspect(args):
    model = _load(args.model, args.imports, args.debug)
    model, graph, the_plan = _planned(model, _planner_kwargs(args))
    _warn_if_no_saving(the_plan, model.name)
    info = describe(model, graph, the_plan, args.batch_size)  # `graph` has the input shapes
    if args.format == "json":
        print(json.dumps(info, indent=2))
    elif args.format == "dot":
        print(to_dot(info, graph))
    else:
        render_table(info, _console())
    return 0


def _measure_pair(builder, builder_kwargs, args, checkpoint_kwargs, input_shape=None):
    """Baseline and graphckpt, alternating, `args.repeats` times, each run
    in a fresh process, with a spinner, on random batches of `input_shape`
    (default: the model's input shapes). Returns a `Comparison`."""
    from graphckpt.measure import Comparison, measure

    console = _console(stderr=True)
    runs = {"baseline": [], "graphckpt": []}
    total = 2 * args.repeats
    for i in range(total):
        method = ("baseline", "graphckpt")[i % 2]
        what = "the baseline" if method == "baseline" else "the checkpointed model"
        with console.status(f"measuring {what} in a fresh process ({i + 1}/{total})..."):
            m = measure(
                builder,
                batch_size=args.batch_size,
                method=method,
                builder_kwargs=builder_kwargs,
                checkpoint_kwargs=checkpoint_kwargs if method == "graphckpt" else None,
                input_shape=input_shape,
                steps=args.steps,
                check=False,
            )
        if not m.ok:
            raise CliError(f"measuring {what} failed (phase {m.phase}): {_gist(m.error)}")
        runs[method].append(m)
    return Comparison(baseline=tuple(runs["baseline"]), candidate=tuple(runs["graphckpt"]))


def _cmd_measure(args):
    import graphckpt

    model = _load(args.model, args.imports, args.debug)
    if isinstance(model, graphckpt.CheckpointedModel):
        raise CliError(
            f"{args.model} is already checkpointed. Tip: measure the original model "
            "(`graphckpt.uncheckpoint(model).save(...)`)."
        )
    kwargs = _planner_kwargs(args)
    the_plan = graphckpt.plan(model, **kwargs)  # bad arguments fail here, before any subprocess
    if the_plan.batch_size is None:
        raise CliError("measure needs a batch size: pass --batch-size N, or --input-shape with the batch first", code=2)
    _warn_if_no_saving(the_plan, model.name)
    args.batch_size = the_plan.batch_size
    builder_kwargs = {"path": os.path.abspath(args.model), "imports": list(args.imports)}
    comparison = _measure_pair(
        "graphckpt.cli:load_model_file", builder_kwargs, args, kwargs, kwargs.get("input_shape")
    )
    render_comparison(comparison, _console(), the_plan)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(comparison.to_dict(), f, indent=2)
    return 0


def demo_model(depth=DEMO["depth"], width=DEMO["width"]):
    """The demo's model: `depth` Dense(width, tanh) layers in a chain, then
    a Dense(1) head (`depth + 1` layers, and the input)."""
    keras = _import_keras()

    inp = keras.Input((width,), name="x")
    x = inp
    for i in range(depth):
        x = keras.layers.Dense(width, activation="tanh", name=f"dense_{i}")(x)
    return keras.Model(inp, keras.layers.Dense(1, name="head")(x), name=f"dense_chain_{depth}x{width}")


def _cmd_demo(args):
    import graphckpt
    from graphckpt.graph import build_graph

    _import_keras()
    console = _console()
    model = demo_model(args.depth, args.width)
    kwargs = _planner_kwargs(args)
    the_plan = graphckpt.plan(model, **kwargs)
    if segment_counts(the_plan)[1] == 0:
        # Nothing to show: the checkpointed model would be the model itself.
        raise CliError(
            f"the demo's plan ({segments_phrase(the_plan)}) checkpoints nothing, so there is nothing to "
            "compare. Tip: run it on a deeper chain (the default is "
            f"--depth {DEMO['depth']}) or with --segments N.",
            code=2,
        )
    console.print(
        f"[bold]graphckpt demo[/bold]: {model.name}, a chain of {_plural(args.depth, 'Dense layer')} "
        f"({args.width} units, tanh) and a Dense(1) head, batch {args.batch_size}.\n\n1. The plan "
        "(graphckpt.plan): a recomputed segment keeps its boundary tensors for backward and recomputes the rest."
    )
    _warn_if_no_saving(the_plan, model.name)
    render_table(describe(model, build_graph(model), the_plan, args.batch_size), console)
    ck = graphckpt.checkpoint_model(model, **kwargs)
    segment_layers = sum(isinstance(layer, graphckpt.Segment) for layer in ck.layers)
    inline = segment_counts(the_plan)[0] - segment_layers
    inline = f"; {inline} {'runs' if inline == 1 else 'run'} inline" if inline > 0 else ""
    console.print(
        f"\n2. The rewrite (graphckpt.checkpoint_model): '{ck.name}', with "
        f"{_plural(segment_layers, 'Segment layer')}, one per recomputed segment ({segments_phrase(the_plan)}"
        f"{inline}), and the same {len(model.weights)} weights.\n\n"
        "3. Measured peak training-step memory, each model trained in a fresh process:"
    )
    builder_kwargs = {"depth": args.depth, "width": args.width}
    render_comparison(_measure_pair("graphckpt.cli:demo_model", builder_kwargs, args, kwargs), console, the_plan)
    return 0


# ---------------------------------------------------------------- main


def _parser():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="on error, print the full traceback")
    planning = argparse.ArgumentParser(add_help=False)
    planning.add_argument(
        "--segments",
        metavar="auto|sqrt|N",
        help="number of segments: 'auto' (default: the count with the least estimated peak), 'sqrt' or an integer",
    )
    planning.add_argument(
        "--budget", metavar="B", help="memory budget: bytes with a unit (2GiB, 800MB), or a fraction of the baseline (0.3)"
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
    p.add_argument("--batch-size", type=_positive_int, metavar="N", help="bytes for a batch of N (default: per example)")
    p.add_argument("--format", choices=("table", "json", "dot"), default="table", help="output format (default: table)")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("measure", parents=[common, loading, planning], help="measure peak memory, baseline vs plan")
    p.add_argument(
        "--batch-size", type=_positive_int, metavar="N", help="examples per training step (or the first dim of --input-shape)"
    )
    p.add_argument("--steps", type=_positive_int, default=5, metavar="N", help="measured training steps (default: 5)")
    p.add_argument("--repeats", type=_positive_int, default=1, metavar="N", help="alternate N baseline/graphckpt pairs (default: 1)")
    p.add_argument("--json", metavar="PATH", help="also write the measurements as JSON to PATH")
    p.set_defaults(func=_cmd_measure)

    p = sub.add_parser("demo", parents=[common, planning], help="plan and measure a built-in deep Dense chain")
    p.add_argument("--depth", type=_positive_int, default=DEMO["depth"], metavar="N", help=f"Dense layers (default: {DEMO['depth']})")
    p.add_argument("--width", type=_positive_int, default=DEMO["width"], metavar="N", help=f"units per layer (default: {DEMO['width']})")
    p.add_argument("--batch-size", type=_positive_int, default=DEMO["batch_size"], metavar="N", help=f"default: {DEMO['batch_size']}")
    p.add_argument("--steps", type=_positive_int, default=5, metavar="N", help="measured training steps (default: 5)")
    p.add_argument("--repeats", type=_positive_int, default=1, metavar="N", help="alternate N baseline/graphckpt pairs (default: 1)")
    p.set_defaults(func=_cmd_demo)
    return parser


def _positive_int(text):
    if re.fullmatch(r"[0-9]+", text) and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a positive integer, received {text!r}")


def _version():
    try:
        from importlib.metadata import version

        return version("graphckpt")
    except Exception:
        return "unknown"


# Python argument -> the flag that sets it.
_FLAGS = {"batch_size": "--batch-size", "input_shape": "--input-shape", "segments": "--segments", "budget": "--budget"}
# Tips written for Python callers, and what the command line says instead.
_TIPS = [
    (re.compile(r"`graphckpt\.plan\(model, batch_size=\.\.\.\)`"), "`graphckpt inspect MODEL.keras --batch-size N`"),
    (re.compile(r"as `input_shape=` \([^()]*\([^()]*\)\) or (`--input-shape [^`]*`) on the command line"), r"as \1"),
    (re.compile(r" The fit flag reads them from arrays[^`]*`[^`]*`\."), ""),
    (re.compile(r"pass `batch_size=`"), "pass `--batch-size N`"),
]
_ASSIGNMENT = re.compile(r"\b(" + "|".join(_FLAGS) + r")=")
_BARE = re.compile(r"-?[0-9][0-9_]*(?:\.[0-9]+)?|[A-Za-z_]\w*")


def _literal_end(text, start):
    """Where the Python literal at `text[start]` ends: a bracketed or quoted
    value (to its balancing bracket or quote), else a bare number or word."""
    if start >= len(text) or text[start] not in "([{'\"":
        match = _BARE.match(text, start)
        return match.end() if match else start
    depth, quote = 0, None
    for i in range(start, len(text)):
        c = text[i]
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if quote is None and depth == 0:
            return i + 1
    return len(text)


def _flag_value(flag, value):
    """`--input-shape 8,512` for `input_shape=(8, 512)`, and so on."""
    if flag == "--input-shape" and isinstance(value, (tuple, list, dict)):
        def dims(shape):
            return ",".join("None" if d is None else str(d) for d in shape)

        if isinstance(value, dict):
            return " ".join(f"{flag} {name}={dims(shape)}" for name, shape in value.items())
        if value and all(isinstance(v, (tuple, list)) for v in value):
            return " ".join(f"{flag} {dims(shape)}" for shape in value)
        return f"{flag} {dims(value)}"
    return f"{flag} {shlex.quote(str(value))}"


def in_flags(message):
    """`message`, from graphckpt's Python API, in the command line's words:
    `batch_size=4` becomes `--batch-size 4`, `` `batch_size` `` becomes
    `` `--batch-size` ``, and tips that show a Python call show a command."""
    for pattern, replacement in _TIPS:
        message = pattern.sub(replacement, message)
    out, pos = [], 0
    for match in _ASSIGNMENT.finditer(message):
        end = _literal_end(message, match.end())
        literal = message[match.end() : end]
        if not literal:  # `batch_size=`, or `batch_size=...`: no value to show
            continue
        try:
            value = ast.literal_eval(literal)
        except (ValueError, SyntaxError):
            value = literal
        out += [message[pos : match.start()], _flag_value(_FLAGS[match.group(1)], value)]
        pos = end
    message = "".join(out) + message[pos:]
    return re.sub(r"`(" + "|".join(_FLAGS) + r")=?`", lambda m: f"`{_FLAGS[m.group(1)]}`", message)


def _show_warning(message, category, filename, lineno, file=None, line=None):
    """Warnings as one line each, like errors: no source line to quote."""
    print(f"graphckpt: warning: {in_flags(' '.join(str(message).split()))}", file=sys.stderr)


def main(argv=None):
    """Runs the graphckpt command line. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    with warnings.catch_warnings(), _quiet_tensorflow():
        if not debug:
            warnings.showwarning = _show_warning
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
