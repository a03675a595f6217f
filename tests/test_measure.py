"""graphckpt.measure: each measurement runs in a fresh process, reads real
allocator figures, sees graphckpt lower the peak, and reports failures."""

import json
import os

import pytest

import graphckpt
from graphckpt.measure import Measurement, MeasurementError, compare, measure
from tests import measure_builders as mb

CHAIN = {"depth": 16, "width": 128}
BATCH = 512
ACTIVATION_BYTES = BATCH * CHAIN["width"] * 4  # one float32 layer output
FAST = {"steps": 2, "warmup": 1, "timeout": 180}


@pytest.fixture(scope="module")
def pair():
    """Baseline and graphckpt default plan on a 16-layer chain, one run each."""
    return compare(mb.chain, batch_size=BATCH, builder_kwargs=CHAIN, repeats=1, **FAST)


def test_measurements_are_sane(pair):
    for m in pair.baseline + pair.candidate:
        assert m.ok, m.error
        assert m.device == "CPU:0" and "get_memory_info" in m.memory_method
        assert m.batch_size == BATCH and len(m.step_times_s) == len(m.step_peak_bytes) == 2
        assert m.peak_bytes == max(m.step_peak_bytes) > 0
        assert m.resident_bytes > 0 and m.step_time_s > 0 and m.first_step_s > 0
        assert Measurement.from_dict(json.loads(json.dumps(m.to_dict()))) == m
        assert len(m.info["graphckpt_source"]["sha256"]) == 12  # which core code ran
    # Backprop through 16 tanh layers keeps at least their 16 outputs.
    assert pair.baseline[0].peak_bytes >= 0.9 * CHAIN["depth"] * ACTIVATION_BYTES


def test_graphckpt_lowers_the_measured_peak(pair):
    base, ck = pair.baseline[0], pair.candidate[0]
    # The default plan's recomputed segments (its last one runs inline).
    expected = graphckpt.plan(mb.chain(**CHAIN))
    assert base.num_segments == 0 and ck.num_segments == sum(s.remat for s in expected.segments) >= 2
    assert ck.peak_bytes < 0.75 * base.peak_bytes
    assert pair.peak_ratio == ck.peak_bytes / base.peak_bytes


def test_each_measurement_runs_in_a_fresh_process(pair):
    pids = {m.info["pid"] for m in pair.baseline + pair.candidate}
    assert len(pids) == 2 and os.getpid() not in pids
    for m in pair.baseline + pair.candidate:
        # The builder's module-level counter starts over in every child.
        assert m.model_name.startswith(f"chain_build1_pid{m.info['pid']}")
        assert m.info["tensorflow"] and m.info["keras"]


def test_the_source_fingerprint_covers_subpackages(tmp_path):
    from graphckpt.measure.child import _source_fingerprint

    (tmp_path / "planner").mkdir()
    (tmp_path / "top.py").write_text("A = 1\n")
    (tmp_path / "planner" / "search.py").write_text("B = 1\n")
    before = _source_fingerprint(str(tmp_path))["sha256"]
    (tmp_path / "planner" / "search.py").write_text("B = 2\n")
    assert _source_fingerprint(str(tmp_path))["sha256"] != before


def test_builder_failure_is_reported():
    with pytest.raises(MeasurementError, match=r"phase 'build'.*ValueError: kaput") as e:
        measure(mb.broken, batch_size=2, builder_kwargs={"message": "kaput"}, **FAST)
    m = e.value.measurement
    assert not m.ok and m.phase == "build" and m.peak_bytes is None


def test_a_crashed_child_is_reported():
    m = measure(mb.crashes, batch_size=2, check=False, **FAST)
    assert not m.ok and m.phase == "subprocess" and "exit status 3" in m.error


def test_a_method_that_returns_no_model_is_reported():
    m = measure(mb.chain, batch_size=2, method=mb.not_a_model, check=False, **FAST)
    assert not m.ok and m.phase == "transform" and "not a keras.Model" in m.error


def test_method_recipes_get_their_kwargs(tmp_path):
    m = measure(
        "tests/measure_builders.py:chain", batch_size=8, method="tests.measure_builders:halves",
        method_kwargs={"keep": 3}, builder_kwargs={"depth": 5, "width": 8}, **FAST,
    )
    assert m.ok and m.num_layers == 4 and m.model_name == "halved"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"builder": lambda: None}, "module-level function"),
        ({"builder": "no_colon"}, "module:function"),
        ({"batch_size": 0}, "batch_size"),
        ({"device": "tpu"}, "device"),
        ({"checkpoint_kwargs": {"segments": 2}}, "method='graphckpt' only"),
        ({"builder_kwargs": {"x": object()}}, "JSON serializable"),
    ],
)
def test_bad_arguments_fail_before_any_process(kwargs, match):
    args = {"builder": mb.chain, "batch_size": 4, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        measure(args.pop("builder"), **args)


def _benchmark_module(name):
    import importlib.util
    import pathlib
    import sys

    bench = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
    saved = list(sys.path)
    try:  # the benchmark scripts put their folder on sys.path; undo that
        spec = importlib.util.spec_from_file_location(f"_bench_{name}", bench / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def _run(label, rnd, peak, time, ok=True):
    return dict(label=label, round=rnd, ok=ok, peak_bytes=peak, step_time_s=time, step_cpu_s=time,
                num_segments=0, error=None if ok else "E: x", phase=None if ok else "train")


def test_benchmark_ratios_pair_each_round_with_its_own_baseline():
    summarize = _benchmark_module("run_all").summarize
    runs = [
        _run("baseline", 0, 100, 1.0), _run("m", 0, 50, 2.0),
        _run("baseline", 1, 200, 4.0), _run("m", 1, 60, 4.4),
        _run("baseline", 2, 100, 1.0), _run("m", 2, 40, 1.3),
        _run("bad", 0, None, None, ok=False),
    ]
    s = summarize(runs)
    assert s["m"]["peak_ratio"] == pytest.approx(0.4)  # median of 0.5, 0.3, 0.4
    assert s["m"]["time_ratio"] == pytest.approx(1.3)  # median of 2.0, 1.1, 1.3
    assert s["m"]["peak_bytes"] == 50 and s["baseline"]["peak_ratio"] == 1.0
    assert not s["bad"]["ok"] and s["bad"]["phase"] == "train" and s["bad"]["peak_ratio"] is None


def test_scaling_exponent_is_the_log_log_slope():
    fit = _benchmark_module("run_all").fit_exponent
    depths = [16, 32, 64, 128, 256]
    assert fit(depths, [3 * d**0.5 for d in depths]) == pytest.approx(0.5)
    assert fit(depths, [7 * d for d in depths]) == pytest.approx(1.0)


def test_cli_measures_a_sequential_model(tmp_path):
    """A Sequential's own `input` exists only once it has been called; the
    random batch is shaped from its inner functional model instead."""
    import keras

    from graphckpt import cli

    model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8, activation="tanh") for _ in range(6)])
    path = tmp_path / "seq.keras"
    model.save(path)
    out = tmp_path / "m.json"
    argv = ["measure", str(path), "--batch-size", "4", "--steps", "1", "--segments", "2", "--repeats", "1", "--json", str(out)]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    (base,), (cand,) = data["baseline"], data["candidate"]
    assert base["ok"] and cand["ok"] and base["peak_bytes"] > 0 and cand["num_segments"] == 2


def test_the_child_loads_a_checkpointed_file(tmp_path):
    """A `.keras` recipe may hold graphckpt's classes: the measured process
    (which imports `graphckpt.measure` before Keras) registers them first."""
    import subprocess
    import sys

    import keras

    inp = keras.Input((8,))
    x = inp
    for _ in range(4):
        x = keras.layers.Dense(8)(x)
    path = tmp_path / "ck.keras"
    graphckpt.checkpoint_model(keras.Model(inp, x), segments=2).save(path)
    code = (
        "from graphckpt.measure import child\n"
        f"model = child._build_model({{'builder': {str(path)!r}, 'builder_kwargs': {{}}}})()\n"
        "print(type(model).__name__)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1:] == ["CheckpointedModel"]


def test_outputs_are_held_once_beside_the_segments():
    """The estimate's fixed part, one output-sized buffer alive through the
    backward pass (graphckpt/estimator/peak.py, `_FIXED_OUTPUTS`), against the
    measured peak of a model whose outputs (8 MiB) dwarf each layer's
    (1 MiB): three times the outputs over-estimated it by a third or more.

    Eight measured steps, not two: TensorFlow's executor orders independent
    ops differently from step to step, and this model's per-step peak spans
    33-52 MiB on one machine (the peak is their maximum); two steps measured
    34 MiB once under CI's load."""
    batch = 256
    model = mb.big_outputs()
    est = graphckpt.estimate(model, graphckpt.plan(model, batch_size=batch), batch_size=batch)
    steps = {**FAST, "steps": 8}
    base = measure(mb.big_outputs, batch_size=batch, **steps)
    ck = measure(mb.big_outputs, batch_size=batch, method="graphckpt", **steps)
    assert base.ok and ck.ok, (base.error, ck.error)
    assert est.baseline_peak_bytes == pytest.approx(base.peak_bytes, rel=0.25)
    assert est.peak_bytes == pytest.approx(ck.peak_bytes, rel=0.25)
