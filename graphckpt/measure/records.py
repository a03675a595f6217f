"""The records a measurement returns: `Measurement`, `Comparison`, and the
error raised when one fails. Plain data, JSON-friendly."""

import dataclasses
import statistics

from graphckpt.errors import GraphckptError


class MeasurementError(GraphckptError, RuntimeError):
    """A measurement failed; `.measurement` holds the failed record."""

    def __init__(self, message, measurement=None):
        super().__init__(message)
        self.measurement = measurement


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One measured run of one model, built by one recipe, in one process.

    Attributes:
        label: a name for this run (defaults to `method`).
        method: `"baseline"`, `"graphckpt"`, or the transform's recipe.
        builder: the model recipe, as a string.
        ok: whether the run completed.
        error: `"ExceptionType: message"` when it did not, else None.
        phase: where it failed: `"build"`, `"transform"`, `"data"`,
            `"compile"`, `"train"`, `"subprocess"` or `"timeout"`.
        device: `"CPU:0"` or `"GPU:0"`.
        memory_method: how the memory figures were read.
        batch_size, steps, warmup, jit_compile: the run's settings.
        peak_bytes: peak training-step memory above the resident state
            (the largest over the measured steps).
        step_peak_bytes: that figure for each measured step.
        resident_bytes: bytes in use before the measured steps.
        step_time_s: median wall time of one training step.
        step_times_s: each measured step's wall time.
        step_cpu_s: median CPU time (all threads of the process) of one
            step; less sensitive than wall time to other load on the machine.
        first_step_s: the first warm-up step (tracing and compiling).
        model_name: the trained model's name.
        num_layers: `len(model.layers)` of the trained model.
        num_segments: how many graphckpt `Segment` layers it has.
        num_params: its parameter count.
        info: versions, pid, python, and the kwargs the run used.
    """

    label: str
    method: str
    builder: str
    ok: bool
    error: str | None = None
    phase: str | None = None
    device: str | None = None
    memory_method: str | None = None
    batch_size: int | None = None
    steps: int | None = None
    warmup: int | None = None
    jit_compile: bool | None = None
    peak_bytes: int | None = None
    step_peak_bytes: tuple = ()
    resident_bytes: int | None = None
    step_time_s: float | None = None
    step_times_s: tuple = ()
    first_step_s: float | None = None
    step_cpu_s: float | None = None
    model_name: str | None = None
    num_layers: int | None = None
    num_segments: int | None = None
    num_params: int | None = None
    info: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)

    def to_dict(self):
        """Plain, JSON-friendly data."""
        d = dataclasses.asdict(self)
        d["step_peak_bytes"] = list(self.step_peak_bytes)
        d["step_times_s"] = list(self.step_times_s)
        return d

    @classmethod
    def from_dict(cls, data):
        names = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in names}
        data["step_peak_bytes"] = tuple(data.get("step_peak_bytes", ()))
        data["step_times_s"] = tuple(data.get("step_times_s", ()))
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A method against the baseline, measured alternately `repeats` times.

    Attributes:
        baseline: the baseline `Measurement`s, in run order.
        candidate: the method's `Measurement`s, in run order.
        peak_ratio: median over repeats of candidate peak / baseline peak
            (runs paired in order), or None if either side failed.
        time_ratio: the same for the median step time.
        cpu_ratio: the same for the median CPU time of a step.
    """

    baseline: tuple
    candidate: tuple

    @property
    def ok(self):
        return all(m.ok for m in self.baseline + self.candidate)

    def ratios(self, attr):
        """Candidate / baseline of the `Measurement` attribute `attr`
        (`"peak_bytes"`, `"step_time_s"`, `"step_cpu_s"`), one per pair of
        runs that both completed, in run order."""
        pairs = [
            (getattr(c, attr), getattr(b, attr))
            for b, c in zip(self.baseline, self.candidate)
            if b.ok and c.ok and getattr(b, attr) and getattr(c, attr) is not None
        ]
        return [c / b for c, b in pairs]

    @property
    def peak_ratio(self):
        r = self.ratios("peak_bytes")
        return statistics.median(r) if r else None

    @property
    def time_ratio(self):
        r = self.ratios("step_time_s")
        return statistics.median(r) if r else None

    @property
    def cpu_ratio(self):
        """The same for the median CPU time of a step (less sensitive than
        wall time to other load on the machine)."""
        r = self.ratios("step_cpu_s")
        return statistics.median(r) if r else None

    def to_dict(self):
        return {
            "baseline": [m.to_dict() for m in self.baseline],
            "candidate": [m.to_dict() for m in self.candidate],
            "peak_ratio": self.peak_ratio,
            "time_ratio": self.time_ratio,
            "cpu_ratio": self.cpu_ratio,
            # Every pair's ratio: their spread is how far to trust the medians.
            "peak_ratios": self.ratios("peak_bytes"),
            "time_ratios": self.ratios("step_time_s"),
            "cpu_ratios": self.ratios("step_cpu_s"),
        }


def format_bytes(n):
    """`1536` -> `"1.5 KiB"`; None -> `"-"`."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


_FROM_SPEC = ("label", "method", "builder", "batch_size", "steps", "warmup", "jit_compile")


def from_spec(spec, **fields):
    """A `Measurement` of the run `spec` describes, with `fields` besides
    the spec's own (label, method, builder, batch and step counts, XLA)."""
    return Measurement(**{k: spec[k] for k in _FROM_SPEC}, **fields)


def failed(spec, phase, error, info=None):
    """The `Measurement` of a run that failed in `phase`."""
    return from_spec(spec, ok=False, error=error, phase=phase, info=info or {})
