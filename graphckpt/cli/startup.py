"""Start-up without TensorFlow's noise: its C++ log lines dropped at
TF_CPP_MIN_LOG_LEVEL, and Keras imported only when a command needs it (so
`--help`, `--version` and argument errors stay fast)."""

import contextlib
import os
import re
import sys
import tempfile

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


def import_keras():
    """Keras, and graphckpt's API (which registers its classes with Keras),
    imported the first time without TensorFlow's start-up lines.

    Returns:
        The `keras` module.
    """
    import graphckpt

    if "keras" not in sys.modules:
        with _native_stderr_filtered(_tf_log_level()):
            import keras  # noqa: F401
    graphckpt.load_api()  # registers graphckpt's classes, for files that hold them
    return sys.modules["keras"]


@contextlib.contextmanager
def quiet_tensorflow():
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
