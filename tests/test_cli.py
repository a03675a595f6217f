"""The `graphckpt` command line: every command run as a real subprocess,
renderers and error cases through `main(argv)` in this process."""

import json
import math
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import keras
import pytest
from keras import layers

import graphckpt
from graphckpt import cli
from graphckpt.cli.loading import gist
from graphckpt.cli.startup import native_log_filter
from graphckpt.estimator.peak import estimate
from graphckpt.graph.build import build_graph
from graphckpt.measure import Comparison, Measurement
from graphckpt.runtime.checkpointed import plan_to_config
from tests import models

ROOT = Path(__file__).resolve().parents[1]
# TensorFlow's C++ log lines: written to stderr while TensorFlow is
# imported, whatever TF_CPP_MIN_LOG_LEVEL says; the CLI filters them.
TF_STARTUP = re.compile(r"^([IWEF][0-9]{4} |WARNING: All log messages before absl|To enable the following instructions)|cuInit")
FRAMEWORKS = {"tensorflow", "keras", "jax", "torch"}
PYTHON_ARGS = re.compile(r"\b(batch_size|input_shape|segments|budget)=|`(batch_size|input_shape|segments|budget)`")


@keras.saving.register_keras_serializable(package="graphckpt_tests")
class TwoDense(keras.Model):
    """A subclassed model the CLI can load but must refuse."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a = layers.Dense(4)
        self.b = layers.Dense(1)

    def call(self, x):
        return self.b(self.a(x))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    keras.utils.set_random_seed(0)
    paths = {
        "multi_io": d / "multi_io.keras",
        "multi_io_ck": d / "multi_io_checkpointed.keras",
        "nested": d / "nested.keras",
        "chain": d / "chain.keras",
        "checkpointed": d / "checkpointed.keras",
        "subclassed": d / "subclassed.keras",
        "text": d / "notes.keras",
        "txt": d / "notes.txt",
        "zip": d / "other.keras",
        "lm": d / "lm.keras",
        "unregistered": d / "unregistered.keras",
        "h5": d / "chain.h5",
        "dir": d,
    }
    multi_io = models.multi_io()
    multi_io.save(paths["multi_io"])
    graphckpt.checkpoint_model(multi_io).save(paths["multi_io_ck"])
    models.nested().save(paths["nested"])
    chain = models.chain(depth=8, width=8)
    chain.save(paths["chain"])
    chain.save(paths["h5"])  # the legacy format, which Keras still loads
    graphckpt.checkpoint_model(chain, segments=3).save(paths["checkpointed"])
    sub = TwoDense()
    sub(keras.ops.ones((1, 3)))
    sub.save(paths["subclassed"])
    paths["text"].write_text("not a model")
    paths["txt"].write_text("not a model either")
    tokens = keras.Input((None,), dtype="int32", name="token_ids")
    keras.Model(tokens, layers.Dense(4)(layers.Embedding(50, 8)(tokens)), name="lm").save(paths["lm"])
    _save_with_an_unregistered_class(paths["unregistered"])
    with zipfile.ZipFile(paths["zip"], "w") as z:
        z.writestr("hello.txt", "a zip, but no model in it")
    return paths


def _save_with_an_unregistered_class(path):
    """A file whose custom layer class nobody has registered by load time:
    the class is registered to save, then forgotten. Its long name makes
    Keras's message longer than the CLI used to show whole."""

    @keras.saving.register_keras_serializable(package="graphckpt_tests_gone")
    class ALayerWhoseModuleTheCommandWasNotToldToImport(layers.Layer):
        def call(self, x):
            return x

    x = keras.Input((3,))
    keras.Model(x, layers.Dense(2)(ALayerWhoseModuleTheCommandWasNotToldToImport()(x))).save(path)
    keras.saving.get_custom_objects().pop("graphckpt_tests_gone>ALayerWhoseModuleTheCommandWasNotToldToImport")


def _env(log_level="3"):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    if log_level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = log_level
    return env


def _run(*argv, script=False, log_level="3"):
    """Starts the CLI in a fresh process: the console script or `-m`.
    `log_level`: TF_CPP_MIN_LOG_LEVEL, None to leave it unset."""
    exe = [str(Path(sys.executable).parent / "graphckpt")] if script else [sys.executable, "-m", "graphckpt"]
    env = _env(log_level)
    return subprocess.Popen(exe + [str(a) for a in argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs(files, tmp_path_factory):
    """All subprocesses start at once (each pays TensorFlow's import) and
    tests wait for the one they check."""
    out = tmp_path_factory.mktemp("cli_out")
    procs = {
        # A checkpointed file: this also proves it loads in a fresh process
        # with no custom_objects (the CLI only imports graphckpt).
        "inspect": _run("inspect", files["multi_io_ck"], "--format", "json", "--batch-size", 4, script=True),
        "measure": _run(
            "measure", files["chain"], "--batch-size", 8, "--steps", 1, "--segments", 2, "--repeats", 2, "--json", out / "m.json"
        ),
        "demo": _run("demo", "--depth", 6, "--width", 16, "--batch-size", 8, "--steps", 1, "--repeats", 1, script=True),
        # Keras's own warnings on loading (a legacy .h5 file: absl's "No
        # training configuration found") are not graphckpt's to print.
        "h5": _run("inspect", files["h5"], "--batch-size", 2),
        "missing": _run("inspect", out / "missing.keras", script=True),
        # TF_CPP_MIN_LOG_LEVEL unset, as in a user's shell.
        "quiet": _run("inspect", files["chain"], "--format", "json", log_level=None),
        "quiet error": _run("inspect", files["chain"], "--budget", "lots", log_level=None),
    }
    results = {}

    def result(name):
        if name not in results:
            stdout, stderr = procs[name].communicate(timeout=300)
            results[name] = (procs[name].returncode, stdout, stderr)
        return results[name]

    result.out = out
    yield result
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


def _error_lines(stderr):
    return [line for line in stderr.splitlines() if line.strip() and not TF_STARTUP.match(line)]


def check_coverage(info, model):
    """Every layer named once (by its path inside nested models), every
    layer call listed once."""
    named = [name for seg in info["segments"] for name in seg["layers"]] + info["outside"]
    assert sorted(named) == sorted({n[0] for n in build_graph(model).nodes})
    calls = [c for seg in info["segments"] for c in seg["calls"]]
    assert len(calls) == len(set(calls)) == info["num_layer_calls"]
    assert [seg["index"] for seg in info["segments"]] == list(range(len(info["segments"])))


# ---------------------------------------------------------------- subprocesses


def test_inspect_json_subprocess_names_every_layer_once(runs, files):
    code, stdout, stderr = runs("inspect")
    assert code == 0, stderr
    info = json.loads(stdout)
    model = keras.saving.load_model(files["multi_io"])
    check_coverage(info, model)
    ck = keras.saving.load_model(files["multi_io_ck"])
    assert [s["calls"] for s in info["segments"]] == [
        [n[0] + (f"#{k}" if k else "") for n, k in zip(seg.nodes, [c[1] for c in config])]
        for seg, config in zip(ck.plan.segments, plan_to_config(build_graph(graphckpt.uncheckpoint(ck)), ck.plan)["segments"])
    ]
    assert sorted(info["outside"]) == ["a", "b"]
    assert [c for s in info["segments"] for c in s["calls"] if c.startswith("shared")] == ["shared", "shared#1", "shared#2"]
    assert info["batch_size"] == 4
    first = info["segments"][0]
    out = ck.plan.segments[0].outputs[0]
    shape = list(build_graph(graphckpt.uncheckpoint(ck)).tensors[out].shape)
    assert first["boundary"][0] == {"tensor": out[0], "shape": shape, "dtype": "float32", "bytes": 4 * math.prod(shape[1:]) * 4}
    # The numbers are graphckpt.estimate's, for the file's own plan.
    memory = estimate(graphckpt.uncheckpoint(ck), ck.plan, batch_size=4)
    assert (info["totals"]["baseline_bytes"], info["totals"]["plan_bytes"]) == (memory.baseline_peak_bytes, memory.peak_bytes)
    assert [s["kept_bytes"] for s in info["segments"]] == [p.held_bytes for p in memory.segments]


def test_measure_subprocess(runs):
    code, stdout, stderr = runs("measure")
    assert code == 0, stderr
    assert "baseline" in stdout and "graphckpt" in stdout and "peak memory x" in stdout
    data = json.loads((runs.out / "m.json").read_text())
    bases, cands = data["baseline"], data["candidate"]
    assert len(bases) == len(cands) == 2 and all(m["ok"] for m in bases + cands)
    assert [m["num_segments"] for m in bases + cands] == [0, 0, 2, 2]
    # The segments column counts as `inspect` does: "N segments, M recomputed".
    assert re.search(r"^│ graphckpt .*│ +2, 2 recomputed │$", stdout, flags=re.M), stdout
    assert {m["batch_size"] for m in bases + cands} == {8}
    ratios = [c["peak_bytes"] / b["peak_bytes"] for b, c in zip(bases, cands)]
    assert data["peak_ratios"] == pytest.approx(ratios)
    assert data["peak_ratio"] == pytest.approx(sum(ratios) / 2)
    # Two pairs: medians with their spread, never one noisy pair's ratio alone.
    assert len(data["time_ratios"]) == 2
    assert "median (min-max) of 2 pairs" in stdout
    assert re.search(r"step time x[0-9.]+ \(x[0-9.]+-x[0-9.]+\)", stdout), stdout


def test_demo_subprocess(runs):
    code, stdout, stderr = runs("demo")
    assert code == 0, stderr
    assert "dense_chain_6x16" in stdout
    # One way to count segments: the plan's table, the rewrite's Segment
    # layers and the measured model's all agree with the plan itself.
    demo_plan = graphckpt.plan(cli.demo_model(6, 16), batch_size=8)
    total = len(demo_plan.segments)
    recomputed = sum(s.remat for s in demo_plan.segments)
    assert 0 < recomputed < total  # the last segment runs inline
    ck = graphckpt.checkpoint_model(cli.demo_model(6, 16), batch_size=8)
    assert sum(isinstance(layer, graphckpt.Segment) for layer in ck.layers) == recomputed
    phrase = f"{total} segments, {recomputed} recomputed"  # total > 1 here
    assert f"7 layer calls in {phrase} (auto, batch 8)" in stdout
    layers_ = f"{recomputed} Segment layer" + ("s" if recomputed > 1 else "")
    inline = f"{total - recomputed} run" + ("s" if total - recomputed == 1 else "")
    assert f"with {layers_}, one per recomputed segment ({phrase}; {inline} inline)" in " ".join(stdout.split())
    assert re.search(rf"^│ graphckpt .*│ +{total}, {recomputed} recomputed │$", stdout, flags=re.M), stdout
    assert _error_lines(stderr) == []
    assert re.search(r"peak memory x[0-9.]+", stdout)
    rows = [line for line in stdout.splitlines() if re.match(r"^│ (baseline|graphckpt) ", line)]
    assert len(rows) == 2
    # One pair of runs (--repeats 1): no step-time ratio to read as a speed-up.
    assert "step time x" not in stdout and "step time not compared: one pair of runs is too noisy" in stdout


def test_keras_loading_messages_are_left_out(runs):
    """Keras says a legacy .h5 file has no training configuration (through
    absl's log): `inspect` never trains, so it loads without compiling."""
    code, stdout, stderr = runs("h5")
    assert code == 0, stderr
    assert "chain: 9 layer calls" in stdout
    assert _error_lines(stderr) == []


def test_error_subprocess_one_line_no_traceback(runs):
    code, stdout, stderr = runs("missing")
    assert code == 1
    assert stdout == ""
    assert "Traceback" not in stderr
    (line,) = _error_lines(stderr)
    assert line.startswith("graphckpt: error: no such file:")


def test_tensorflow_startup_lines_are_not_shown(runs):
    # TensorFlow writes its C++ start-up lines (and, on a machine without a
    # GPU, `E0000 ... failed call to cuInit`) while it is imported.
    code, stdout, stderr = runs("quiet")
    assert code == 0, stderr
    json.loads(stdout)
    assert stderr == ""
    code, stdout, stderr = runs("quiet error")  # --budget is checked by graphckpt.budget: it imports Keras
    assert code == 2 and stdout == ""
    (line,) = stderr.splitlines()
    assert line.startswith("graphckpt: error: Invalid `--budget`")


def _imported_modules(argv):
    """The exit status of `python -X importtime -m graphckpt *argv`, and the
    top-level packages it imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "graphckpt", *argv], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120
    )
    names = re.findall(r"^import time:\s+[0-9]+ \|\s+[0-9]+ \|\s*([\w.]+)$", proc.stderr, flags=re.M)
    assert "graphckpt.cli" in names  # the output is what we think it is
    return proc.returncode, {name.split(".")[0] for name in names}


@pytest.mark.parametrize(
    "argv, code",
    [
        (["--help"], 0),
        (["--version"], 0),
        (["inspect", "--help"], 0),
        (["inspect", "model.keras", "--segments", "many"], 2),
        (["inspect", "model.keras", "--input-shape", "8,x"], 2),
        (["demo", "--depth", "0"], 2),
        (["frobnicate"], 2),
    ],
    ids=["help", "version", "inspect help", "bad segments", "bad input shape", "bad depth", "unknown command"],
)
def test_help_version_and_argument_errors_import_no_framework(argv, code):
    returncode, imported = _imported_modules(argv)
    assert returncode == code
    assert not imported & FRAMEWORKS, sorted(imported & FRAMEWORKS)


@pytest.mark.parametrize(
    "imports",
    [
        # `import graphckpt` imports no framework; naming a class loads the
        # Keras side, which registers graphckpt's classes.
        "import sys, graphckpt\n"
        "assert not {'tensorflow', 'keras', 'jax', 'torch'} & set(sys.modules), sorted(sys.modules)\n"
        "from graphckpt import CheckpointedModel\n"
        "import keras\n",
        # With Keras imported first, `import graphckpt` registers them itself.
        "import keras\nimport graphckpt\n",
    ],
    ids=["named class", "keras first"],
)
def test_a_checkpointed_file_loads_with_no_custom_objects(files, imports):
    # In a fresh process, as docs/api.md says a script does it.
    script = imports + (
        f"model = keras.saving.load_model({str(files['checkpointed'])!r})\n"
        "assert isinstance(model, graphckpt.CheckpointedModel) and callable(graphckpt.plan) and callable(graphckpt.estimate)\n"
        "print(sum(isinstance(l, graphckpt.Segment) for l in model.layers))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["3"]


def test_native_log_filter_drops_only_tensorflow_lines_below_the_level():
    lines = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
        "I0000 00:00:1796318968.351520   22727 cudart_stub.cc:31] Could not find cuda drivers on your machine.\n",
        "I0000 00:00:1796318968.448479   22727 cpu_feature_guard.cc:227] This TensorFlow binary is optimized.\n",
        "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow.\n",
        "UserWarning: something from Python\n",
        "E0000 00:00:1796318981.840089   22727 cuda_platform.cc:52] failed call to cuInit: INTERNAL\n",
        "F0000 00:00:1796318981.840089   22727 x.cc:1] fatal\n",
    ]
    assert native_log_filter(lines, 3) == [lines[4], lines[6]]
    assert native_log_filter(lines, 2) == [lines[4], lines[5], lines[6]]
    assert native_log_filter(lines, 0) == lines  # TF_CPP_MIN_LOG_LEVEL=0: the user asked for them


# ---------------------------------------------------------------- in process


def run_main(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect_table(capsys, files):
    code, out, err = run_main(capsys, "inspect", files["chain"], "--segments", 3, "--batch-size", 2)
    assert code == 0, err
    assert "chain: 9 layer calls in 3 segments, 3 recomputed (fixed, batch 2)" in out
    for header in ("seg", "calls", "first, last call", "boundary tensors", "kept", "peak"):
        assert header in out
    assert "estimated peak training-step memory (for a batch of 2):\n  baseline" in out


def test_short_names_are_the_shortest_unambiguous_ends_of_paths():
    from graphckpt.cli.report import short_names

    names = ["dense", "block/dense", "block@1/dense", "backbone/conv", "backbone/inner/relu", "shared#1", "backbone/shared#1"]
    assert short_names(names) == {
        "dense": "dense",  # a top-level call keeps its name
        "block/dense": "block/dense",  # `dense` alone would be the top-level one
        "block@1/dense": "block@1/dense",
        "backbone/conv": "conv",
        "backbone/inner/relu": "relu",
        "shared#1": "shared#1",
        "backbone/shared#1": "backbone/shared#1",
    }


@pytest.fixture
def long_nested(tmp_path):
    """A transfer-learning model whose backbone has a long name, as
    keras.applications' do (`mobilenetv2_1.00_96`)."""
    inp = keras.Input((8,), name="pixels")
    x = inp
    for name in ("stem_conv", "block_1_expand", "block_1_expand_relu", "block_1_project", "block_2_add"):
        x = layers.Dense(8, activation="relu", name=name)(x)
    base = keras.Model(inp, x, name="a_pretrained_backbone_1.00_224")
    outer_in = keras.Input((8,), name="image")
    model = keras.Model(outer_in, layers.Dense(2, name="head")(base(outer_in)), name="transfer")
    path = tmp_path / "transfer.keras"
    model.save(path)
    return path


def test_inspect_names_calls_relative_to_the_model_and_cuts_no_name(capsys, monkeypatch, long_nested):
    """At 80 columns (COLUMNS, as a terminal sets it) every line fits and no
    name is cut short: the backbone's path is shown once, and `--wide`
    shows every path in full."""
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run_main(capsys, "inspect", long_nested, "--segments", 3, "--batch-size", 2)
    assert code == 0, err
    lines = out.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    assert "…" not in out
    # The headers, each on one line ("peak in / its / backward" wrapped).
    assert re.search(r"^┃ seg ┃ calls ┃ first, last call +┃ boundary tensors +┃ +kept ┃ +peak ┃$", out, flags=re.M), out
    # The backbone's path once, in the note; its layers by their own names.
    assert out.count("a_pretrained_backbone_1.00_224/") == 1
    assert "(stem_conv: a_pretrained_backbone_1.00_224/stem_conv; --wide: full paths)" in " ".join(out.split())
    for name in ("stem_conv", "block_1_expand_relu", "head"):
        assert re.search(rf"│ {name} ", out), name

    code, out, _ = run_main(capsys, "inspect", long_nested, "--segments", 3, "--batch-size", 2, "--wide")
    assert code == 0 and "…" not in out and "--wide: full paths" not in out
    assert max(len(line.rstrip()) for line in out.splitlines()) <= 80
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run_main(capsys, "inspect", long_nested, "--segments", 3, "--batch-size", 2, "--wide")
    assert "│ a_pretrained_backbone_1.00_224/stem_conv " in out


def test_inspect_says_what_batch_size_it_planned_for(capsys, files):
    """The best plan depends on the batch size (weight-sized buffers don't
    grow with it): the title says which one, and without one a line says
    to pass it."""
    code, out, _ = run_main(capsys, "inspect", files["chain"])
    assert code == 0
    assert "(auto, per example)" in out and "pass --batch-size N" in out
    code, out, _ = run_main(capsys, "inspect", files["chain"], "--batch-size", 4)
    assert "(auto, batch 4)" in out and "per example" not in out


def test_only_graphckpt_warnings_carry_its_name(capsys, files, monkeypatch, tmp_path):
    """Another library's warning goes on to Python's own handling (here
    pytest's), not relabelled `graphckpt: warning:`."""
    (tmp_path / "noisy_module.py").write_text("import warnings\nwarnings.warn('a warning from another library', UserWarning)\n")
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match="a warning from another library"):
        code, _, err = run_main(capsys, "inspect", files["chain"], "--import", "noisy_module")
    assert code == 0, err
    assert "graphckpt: warning" not in err
    code, _, err = run_main(capsys, "inspect", files["lm"], "--batch-size", 2)  # graphckpt's own
    assert err.startswith("graphckpt: warning: ")


def _run_record(method, peak, seconds, cpu):
    return Measurement(label=method, method=method, builder="b", ok=True, peak_bytes=peak, step_time_s=seconds, step_cpu_s=cpu)


def test_one_pair_of_runs_gives_no_step_time_ratio():
    """A single noisy pair read as `step time x0.42`: no time ratio without
    the spread of several pairs."""
    from graphckpt.cli.report import comparison_line

    one = Comparison(baseline=(_run_record("baseline", 100, 1.0, 1.0),), candidate=(_run_record("graphckpt", 50, 0.42, 1.3),))
    line = comparison_line(one)
    assert "peak memory x0.50, 50% less" in line
    assert "x0.42" not in line and "step time not compared" in line


def test_several_pairs_give_medians_with_their_spread():
    from graphckpt.cli.report import comparison_line

    pairs = [(1.0, 1.3), (1.0, 0.42), (2.0, 3.0)]
    c = Comparison(
        baseline=tuple(_run_record("baseline", 100, b, b) for b, _ in pairs),
        candidate=tuple(_run_record("graphckpt", 40, g, 1.25 * b) for b, g in pairs),
    )
    line = comparison_line(c)
    assert "median (min-max) of 3 pairs" in line
    assert "step time x1.30 (x0.42-x1.50)" in line
    assert "CPU time x1.25 (x1.25-x1.25)" in line


def test_inspect_nested_json_and_dot(capsys, files):
    code, out, _ = run_main(capsys, "inspect", files["nested"], "--format", "json")
    assert code == 0
    info = json.loads(out)
    model = keras.saving.load_model(files["nested"])
    check_coverage(info, model)
    assert info["kept_whole"] == {}  # every nested call flattened
    calls = [c for s in info["segments"] for c in s["calls"]]
    # Inside the block, called twice: each call's layers under its own path.
    block = model.get_layer("block")
    for layer in block.layers[1:]:
        assert f"block/{layer.name}" in calls and f"block@1/{layer.name}" in calls

    code, out, _ = run_main(capsys, "inspect", files["nested"], "--format", "dot")
    assert code == 0
    assert out.startswith('digraph "nested" {') and out.rstrip().endswith("}")
    assert out.count("subgraph cluster_") == len(info["segments"])
    declared = re.findall(r'^    ("[^"]+");$', out, flags=re.M)
    assert sorted(json.loads(d) for d in declared) == sorted(c for s in info["segments"] for c in s["calls"])
    assert out.count(" -> ") == build_graph(model).number_of_edges()


def test_inspect_names_a_nested_model_it_cannot_cut_into(capsys, tmp_path):
    i = keras.Input((4,))
    h = keras.layers.Dense(4)(i)
    two = keras.Model(i, [keras.layers.Dense(4, name="used")(h), keras.layers.Dense(4, name="dead")(h)], name="two")
    inp = keras.Input((4,))
    used, _ = two(inp)
    path = tmp_path / "whole.keras"
    keras.Model(inp, keras.layers.Dense(1)(keras.layers.Dense(4)(used))).save(path)
    code, out, err = run_main(capsys, "inspect", path, "--segments", 2, "--batch-size", 2)
    assert code == 0, err
    assert "nested model 'two' is one layer call, no cut inside it: its call of 'dead' leads only to outputs" in " ".join(out.split())
    code, out, _ = run_main(capsys, "inspect", path, "--segments", 2, "--batch-size", 2, "--format", "json")
    assert list(json.loads(out)["kept_whole"]) == ["two"]


def test_inspect_a_checkpointed_file_shows_its_own_plan(capsys, files):
    code, out, _ = run_main(capsys, "inspect", files["checkpointed"], "--format", "json")
    assert code == 0
    info = json.loads(out)
    assert len(info["segments"]) == 3
    check_coverage(info, graphckpt.uncheckpoint(keras.saving.load_model(files["checkpointed"])))
    code, out, _ = run_main(capsys, "inspect", files["checkpointed"], "--format", "json", "--segments", 2)
    assert len(json.loads(out)["segments"]) == 2


def test_inspect_with_a_budget(capsys, files):
    code, out, err = run_main(capsys, "inspect", files["chain"], "--budget", "0.8", "--batch-size", 16, "--format", "json")
    assert code == 0, err
    info = json.loads(out)
    assert info["strategy"] == "budget" and info["batch_size"] == 16
    assert info["totals"]["plan_bytes"] <= 0.8 * info["totals"]["baseline_bytes"]
    check_coverage(info, keras.saving.load_model(files["chain"]))


def test_inspect_shows_segments_cut_again(capsys, tmp_path):
    """A budget below what plans of one level reach: the JSON lists each
    segment's inner segments (covering its calls), the table writes them
    as `calls = a+b*`."""
    from graphckpt.estimator.peak import node_costs
    from graphckpt.planner import smallest_peak

    model = models.chain(depth=24, bn=True)
    path = tmp_path / "chain24.keras"
    model.save(path)
    graph = build_graph(model)
    budget = int(0.95 * smallest_peak(graph, node_costs(graph, 4)))
    code, out, err = run_main(capsys, "inspect", path, "--budget", budget, "--batch-size", 4, "--format", "json")
    assert code == 0, err
    info = json.loads(out)
    cut = [s for s in info["segments"] if s["inner"]]
    assert cut and all(s["recomputed"] for s in cut)
    for seg in cut:
        assert sum(sub["num_calls"] for sub in seg["inner"]) == seg["num_calls"]
        assert seg["inner"][0]["first"] == seg["first"] and seg["inner"][-1]["last"] == seg["last"]
    assert info["totals"]["plan_bytes"] <= budget
    code, out, err = run_main(capsys, "inspect", path, "--budget", budget, "--batch-size", 4)
    assert code == 0, err
    first = cut[0]
    parts = "+".join(str(sub["num_calls"]) + ("" if sub["recomputed"] else "*") for sub in first["inner"])
    assert f"{first['num_calls']} = {parts}" in out
    assert "cut again (two levels)" in out


def test_import_option(capsys, files):
    code, _, err = run_main(capsys, "inspect", files["chain"], "--import", "tests.models")
    assert code == 0, err
    code, _, err = run_main(capsys, "inspect", files["chain"], "--import", "no_such_module_xyz")
    assert code == 1 and "no_such_module_xyz" in err


ERRORS = {
    "missing file": (1, ["inspect", "{dir}/missing.keras"], "no such file"),
    "directory": (1, ["inspect", "{dir}"], "is a directory"),
    "not a zip": (1, ["inspect", "{text}"], "is not a Keras model file"),
    "zip without a model": (1, ["inspect", "{zip}"], "could not load"),
    "subclassed model": (1, ["inspect", "{subclassed}"], "subclassed model"),
    "subclassed model, measure": (1, ["measure", "{subclassed}", "--batch-size", "2"], "subclassed model"),
    "checkpointed model, measure": (1, ["measure", "{checkpointed}", "--batch-size", "2"], "already checkpointed"),
    "segments not a number": (2, ["inspect", "{chain}", "--segments", "many"], "--segments must be"),
    "segments zero": (2, ["inspect", "{chain}", "--segments", "0"], "--segments must be"),
    "segments too many": (2, ["inspect", "{chain}", "--segments", "99"], "`--segments` must be"),
    "budget not a size": (2, ["inspect", "{chain}", "--budget", "lots"], "Invalid `--budget`"),
    "budget unit": (2, ["measure", "{chain}", "--batch-size", "2", "--budget", "3 parsecs"], "Invalid `--budget`"),
    "budget in bytes, no batch size": (2, ["inspect", "{chain}", "--budget", "2KiB"], "needs the batch size"),
    "budget too small": (2, ["inspect", "{chain}", "--budget", "10", "--batch-size", "4"], "No plan fits"),
    "segments and budget": (2, ["inspect", "{chain}", "--budget", "0.5", "--segments", "2"], "pass one"),
    "measure without batch size": (2, ["measure", "{chain}"], "--batch-size"),
    "unknown command": (2, ["frobnicate"], "invalid choice"),
    "bad format": (2, ["inspect", "{chain}", "--format", "svg"], "invalid choice"),
    "not a model file": (1, ["inspect", "{txt}"], "Tip: pass a model saved with `model.save('model.keras')`"),
    "unregistered class": (1, ["inspect", "{unregistered}"], "Tip: pass --import MODULE"),
    "input shape rank": (2, ["inspect", "{lm}", "--input-shape", "8,512,1"], "Received: --input-shape 8,512,1."),
    "input shape and batch size": (2, ["inspect", "{lm}", "--input-shape", "8,512", "--batch-size", "4"], "and --batch-size 4."),
    "demo too shallow": (2, ["demo", "--depth", "1"], "checkpoints nothing"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_are_one_line_without_traceback(capsys, files, case):
    expected_code, argv, message = ERRORS[case]
    argv = [a.format(**{k: str(v) for k, v in files.items()}) for a in argv]
    code, out, err = run_main(capsys, *argv)
    assert code == expected_code
    assert out == ""
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith("graphckpt: error: ") and message in line
    # In the command's own words: flags, not Python arguments.
    assert not PYTHON_ARGS.search(line), line
    # --import helps only with classes Keras could not find.
    assert ("--import" in line) == (case == "unregistered class"), line


def test_load_errors_are_whole_sentences(capsys, files):
    code, _, err = run_main(capsys, "inspect", files["unregistered"])
    assert code == 1
    # Keras's whole message, which is longer than the 300 characters that
    # used to be shown, then the tip.
    assert "Could not locate class 'ALayerWhoseModuleTheCommandWasNotToldToImport'." in err
    assert "so that the decorator is run before trying to load them. Tip: pass --import MODULE" in err
    assert "..." not in err


def test_gist_cuts_at_a_sentence_or_a_word():
    long = "First sentence here. " + "Second sentence is rather long " * 10 + "and ends here."
    assert gist(ValueError(long), limit=60) == "First sentence here."
    one = "word " * 50
    cut = gist(ValueError(one), limit=30)
    assert cut.endswith("word ...") and len(cut) <= 34


def test_warnings_name_flags(capsys, files):
    code, _, err = run_main(capsys, "inspect", files["lm"], "--batch-size", 2)
    assert code == 0
    (line,) = err.strip().splitlines()
    assert line.startswith("graphckpt: warning: ") and "unknown non-batch dimensions" in line
    assert "--input-shape 8,512" in line and not PYTHON_ARGS.search(line), line
    assert "fit flag" not in line  # the tip for Python callers


def test_a_plan_that_raises_the_estimated_peak_is_a_warning(capsys, files):
    # One segment, recomputed, over the whole model: its backward holds its
    # input and the whole interior again, more than the model without a plan.
    model = keras.saving.load_model(files["chain"])
    one = graphckpt.plan(model, segments=1, batch_size=2)
    assert one.estimated_peak_bytes > one.baseline_peak_bytes
    code, out, err = run_main(capsys, "inspect", files["chain"], "--segments", 1, "--batch-size", 2)
    assert code == 0
    assert "9 layer calls in 1 segment, 1 recomputed (fixed, batch 2)" in out  # not "1 segments"
    (line,) = err.strip().splitlines()
    assert line.startswith("graphckpt: warning: the plan for model 'chain' (1 segment, 1 recomputed) raises the estimated peak")
    code, out, err = run_main(capsys, "inspect", files["chain"], "--segments", 3, "--batch-size", 2)
    assert code == 0 and err == ""  # a plan that lowers it: no warning


def test_segment_counts_agree_with_the_checkpointed_model(capsys, files):
    model = keras.saving.load_model(files["chain"])
    code, out, _ = run_main(capsys, "inspect", files["chain"], "--format", "json", "--batch-size", 2)
    info = json.loads(out)
    ck = graphckpt.checkpoint_model(model, batch_size=2)
    assert info["num_segments"] == len(info["segments"]) == len(ck.plan.segments)
    assert info["num_recomputed"] == sum(s["recomputed"] for s in info["segments"])
    assert info["num_recomputed"] == sum(isinstance(layer, graphckpt.Segment) for layer in ck.layers)
    e = graphckpt.estimate(model, ck.plan, batch_size=2)
    assert info["totals"]["recompute_time_fraction"] == pytest.approx(e.recompute_seconds / e.forward_seconds)
    assert info["totals"]["recompute_fraction"] == pytest.approx(e.recompute_flops / e.forward_flops)
    assert 0 < info["totals"]["recompute_time_fraction"] < 1


def test_help_and_version_return_zero(capsys):
    code, out, _ = run_main(capsys, "--help")
    assert code == 0 and "inspect" in out and "measure" in out and "demo" in out
    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out.startswith("graphckpt ")


def test_debug_shows_the_traceback(capsys, files):
    code, _, err = run_main(capsys, "--debug", "inspect", files["subclassed"])
    assert code == 1
    assert "Traceback" in err and "UnsupportedModelError" in err
    assert err.strip().splitlines()[-1].startswith("graphckpt: error: ")


@pytest.mark.parametrize(
    "text, expected", [("2GiB", "2GiB"), ("512 MiB", "512 MiB"), ("0.3", 0.3), (".5", 0.5), ("4096", 4096)]
)
def test_budget_arg(text, expected):
    assert cli.budget_arg(text) == expected


@pytest.mark.parametrize("text", ["", "-1GiB", "0", "GiB", "2 GiBs", "1.5"])
def test_budget_arg_rejects(text):
    with pytest.raises(graphckpt.InvalidArgumentError, match="budget"):
        cli.budget_arg(text)


def test_docs_describe_the_demo_model_they_run():
    # README and docs/cli.md say how deep the demo's chain is: the model agrees.
    model = cli.demo_model()
    dense = [layer for layer in model.layers if isinstance(layer, layers.Dense) and layer.name != "head"]
    readme = (ROOT / "README.md").read_text()
    (depth,) = re.findall(r"make demo .*a built-in chain of ([0-9]+) Dense layers", readme)
    assert int(depth) == len(dense) == cli.DEMO["depth"]
    assert f"a chain of {len(dense)} Dense layers" in (ROOT / "docs" / "cli.md").read_text()
    assert "64-layer model" not in readme


def test_inspect_open_layers_names_cuts_by_their_path_inside_the_layer(capsys, tmp_path):
    """`--open-layers` plans inside MultiHeadAttention; the JSON rows name
    the calls inside by their path (`<attention>/<call>`); the saved
    checkpointed model shows the plan it was saved with, opened again."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((16, 8))
    x = inp
    for _ in range(2):
        x = layers.Add()([x, layers.MultiHeadAttention(2, 4, dropout=0.1)(x, x)])
    model = keras.Model(inp, layers.Dense(1)(x), name="attn")
    path = tmp_path / "attn.keras"
    model.save(path)
    code, out, err = run_main(capsys, "inspect", path, "--open-layers", "--segments", 4, "--format", "json")
    assert code == 0, err
    info = json.loads(out)
    names = [name for seg in info["segments"] for name in seg["layers"]]
    for inner in (r"softmax(_\d+)?", "attention_output"):
        assert len([n for n in names if re.fullmatch(rf"multi_head_attention(_\d+)?/{inner}", n)]) == 2, names
    ck_path = tmp_path / "attn_ck.keras"
    graphckpt.checkpoint_model(model, segments=4, open_layers=True).save(ck_path)
    code, out, err = run_main(capsys, "inspect", ck_path, "--format", "json")
    assert code == 0, err
    # The same cuts; the attention layers' own Softmax and Dropout, which
    # their config does not name, get new name suffixes when loaded.
    def base(segments):
        return [[re.sub(r"_\d+$", "", n) for n in seg["layers"]] for seg in segments]

    assert base(json.loads(out)["segments"]) == base(info["segments"])
