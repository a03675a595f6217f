"""The command line's arguments: parsing, checking, and graphckpt's Python
messages said in flags (`batch_size=4` -> `--batch-size 4`)."""

import argparse
import ast
import re
import shlex

from graphckpt.cli.startup import import_keras
from graphckpt.errors import GraphckptError


class CliError(GraphckptError):
    """An error the CLI reports as one line. `code` is the exit status."""

    def __init__(self, message, code=1):
        super().__init__(message)
        self.code = code


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
    import_keras()  # graphckpt.budget imports the estimator, and so Keras
    from graphckpt.budget import parse_budget

    value = text.strip()
    if re.fullmatch(r"[0-9]+", value):
        value = int(value)
    elif re.fullmatch(r"[0-9]*\.[0-9]+", value):
        value = float(value)
    parse_budget(value)  # raises InvalidArgumentError, naming the accepted forms
    return value


def planner_kwargs(args):
    """`graphckpt.plan` keywords from the command line."""
    kwargs = {}
    if args.segments is not None:
        kwargs["segments"] = parse_segments(args.segments)
    if args.budget is not None:
        kwargs["budget"] = budget_arg(args.budget)
    if getattr(args, "open_layers", False):
        kwargs["open_layers"] = True
    if getattr(args, "attention_chunks", None):
        kwargs["attention_chunks"] = args.attention_chunks
    if getattr(args, "batch_size", None):
        kwargs["batch_size"] = args.batch_size
    input_shape = parse_input_shapes(getattr(args, "input_shape", None))
    if input_shape is not None:
        kwargs["input_shape"] = input_shape
    return kwargs


def positive_int(text):
    if re.fullmatch(r"[0-9]+", text) and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a positive integer, received {text!r}")


# Python argument -> the flag that sets it.
_FLAGS = {
    "batch_size": "--batch-size",
    "input_shape": "--input-shape",
    "segments": "--segments",
    "budget": "--budget",
    "open_layers": "--open-layers",
    "attention_chunks": "--attention-chunks",
}
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
