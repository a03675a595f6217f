"""What the fit flag says to its user: one line on what a flagged `fit`
planned, and a note on the error Keras raises when the flag is used
without `graphckpt.install()`. Imports no Keras."""

import re
import sys

__all__ = ["plan_line", "say_plan", "install_hint", "add_hint_to_uncaught_errors"]


def plan_line(model, the_plan):
    """What the flag planned, in one line: segments, recomputed calls, the
    estimated peak against the baseline, and the batch size planned for
    (the plan depends on it: weight-sized buffers do not grow with it)."""
    from graphckpt.planner.data import format_bytes

    recomputed = [s for s in the_plan.segments if s.remat]
    calls = sum(len(s.nodes) for s in recomputed)
    batch = "per example" if the_plan.batch_size is None else f"for batches of {the_plan.batch_size}"
    segments = f"{len(the_plan.segments)} segment" + ("" if len(the_plan.segments) == 1 else "s")
    line = (
        f"graphckpt: model '{model.name}', planned {batch}: {segments}, "
        f"{len(recomputed)} recomputed ({calls} of {the_plan.num_layer_calls} layer calls run again in backward)"
    )
    peak, baseline = the_plan.estimated_peak_bytes, the_plan.baseline_peak_bytes
    if peak is not None and baseline:
        line += (
            f"; estimated peak {format_bytes(peak)} against {format_bytes(baseline)} without (x{peak / baseline:.2f})"
        )
    return line


def say_plan(model, the_plan, verbose):
    """`plan_line` on stdout, where Keras's progress goes, unless `verbose=0`."""
    if verbose not in (0, False):
        print(plan_line(model, the_plan), flush=True)


# Python rejects an unknown keyword before any Keras code runs, so without
# `install()` nothing can turn `fit(gradient_checkpointing=...)` into a
# graphckpt error; an uncaught one gets a note that says what to do.
_FLAG_REJECTED = re.compile(r"fit\(\) got an unexpected keyword argument '(gradient_checkpointing|budget)'")
_HINT = (
    "graphckpt: `fit` takes `gradient_checkpointing=` after `graphckpt.install()`. Tip: call "
    "`graphckpt.install()` first, or `graphckpt.fit(model, x, y, ..., gradient_checkpointing=True)`, "
    "which patches nothing."
)


def install_hint(error):
    """Adds `_HINT` to `error` (as a note, shown under its traceback) if it
    is the `TypeError` of `fit(gradient_checkpointing=...)` without
    `install()`. Returns whether it did."""
    if not isinstance(error, TypeError) or not _FLAG_REJECTED.search(str(error)) or not hasattr(error, "add_note"):
        return False
    if _HINT not in getattr(error, "__notes__", ()):
        error.add_note(_HINT)
    return True


def _hinting_excepthook(previous):
    def excepthook(kind, error, traceback):
        install_hint(error)
        previous(kind, error, traceback)

    excepthook._graphckpt_hint = True
    return excepthook


def add_hint_to_uncaught_errors():
    """Wraps `sys.excepthook` (once) so that an uncaught flag error gets
    `_HINT`: it only adds a note, then hands the error to the hook it
    wrapped. Python 3.11+ (`BaseException.add_note`)."""
    if sys.version_info >= (3, 11) and not getattr(sys.excepthook, "_graphckpt_hint", False):
        sys.excepthook = _hinting_excepthook(sys.excepthook)
