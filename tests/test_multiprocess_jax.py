"""A checkpointed model trains under multi-process JAX: two processes on
this machine, `jax.distributed.initialize` (gloo CPU collectives between
the processes, as between hosts), `keras.distribution.DataParallel` over
the two processes' devices, and `fit`, each process feeding its own half of
every global batch (`auto_shard_dataset = False`: the data is sharded by
hand). Keras makes one global array of the halves
(`jax.make_array_from_process_local_data`), so the two processes take the
same steps, which are a single process's steps on whole batches.

Each worker is a fresh process run from this file as a script, with
`KERAS_BACKEND=jax`; the test itself runs under any backend.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.test_distribute import WIDTH, _model  # the same 8-layer tanh chain

BATCH, STEPS, EPOCHS = 16, 4, 3


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run(processes, logs):
    """Runs `processes` workers (1: no cluster) and returns each one's JSON
    line. Their output goes to files in `logs`: a pipe left unread while
    another worker is waited on fills up and blocks its worker, and the
    other then fails at the shutdown barrier."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="jax")
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__)))] + sys.path)
    port = str(_free_port()) if processes > 1 else "none"
    procs = []
    for i in range(processes):
        out, err = (open(os.path.join(logs, f"{processes}_{i}.{kind}"), "w+") for kind in ("out", "err"))
        procs.append((subprocess.Popen([sys.executable, __file__, str(i), port], env=env, stdout=out, stderr=err), out, err))
    results = []
    for proc, out, err in procs:
        proc.wait(timeout=600)
        out.seek(0)
        err.seek(0)
        lines = [line for line in err.read().splitlines() if not line.lstrip().startswith("@")]  # no stack frames
        assert proc.returncode == 0, "\n".join(lines)[-4000:]
        results.append(json.loads(out.read().strip().splitlines()[-1]))
        out.close()
        err.close()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("jax_processes"))
    return _run(2, logs), _run(1, logs)[0]


def test_two_processes_train_the_checkpointed_model_as_one_process(runs):
    workers, single = runs
    assert [w["devices"] for w in workers] == [2, 2]
    assert single["devices"] == 1
    for w in workers:
        for kind in ("checkpointed", "fit_flag"):
            # In each process, the checkpointed model's steps are the plain model's.
            np.testing.assert_allclose(w[kind], w["plain"], rtol=1e-6)
            np.testing.assert_allclose(w[kind + "_weights"], w["plain_weights"], rtol=1e-6)
        np.testing.assert_allclose(w["checkpointed_bn"], w["plain_bn"], rtol=1e-6)
    # Gradients all-reduced: both processes hold the same weights...
    np.testing.assert_allclose(workers[0]["checkpointed_weights"], workers[1]["checkpointed_weights"], rtol=1e-6)
    # ...those of one process on whole batches (BatchNorm too: its statistics
    # are over the global batch, one SPMD program).
    np.testing.assert_allclose(workers[0]["checkpointed"], single["plain"], rtol=1e-5)
    np.testing.assert_allclose(workers[0]["checkpointed_weights"], single["plain_weights"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(workers[0]["checkpointed_bn"], single["plain_bn"], rtol=1e-5)
    assert workers[0]["checkpointed"][-1] < workers[0]["checkpointed"][0]


# ---------------------------------------------------------------- the worker


def _train(index, processes, how, bn):
    """Loss per epoch and the trainable weights after `fit`."""
    import keras

    import graphckpt

    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, BATCH, WIDTH)).astype("float32")
    y = rng.normal(size=(STEPS, BATCH, 2)).astype("float32")
    half = BATCH // processes
    # This process's part of every global batch.
    x = x[:, index * half : (index + 1) * half].reshape(-1, WIDTH)
    y = y[:, index * half : (index + 1) * half].reshape(-1, 2)
    model = _model(bn)
    if how == "checkpointed":
        model = graphckpt.checkpoint_model(model, segments=3)
        assert graphckpt.is_checkpointed(model)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    flag = {"gradient_checkpointing": True} if how == "fit_flag" else {}
    history = model.fit(x, y, batch_size=half, epochs=EPOCHS, shuffle=False, verbose=0, **flag)
    weights = np.concatenate([np.ravel(np.asarray(v.value)) for v in model.trainable_variables]).tolist()
    return history.history["loss"], weights


def _worker(index, port):
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    processes = 1
    if port != "none":
        processes = 2
        jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=index)
    import keras

    import graphckpt

    graphckpt.install()  # the fit flag
    distribution = keras.distribution.DataParallel(devices=jax.devices())
    distribution.auto_shard_dataset = False  # each process passes its own part
    keras.distribution.set_distribution(distribution)
    out = {"devices": len(jax.devices())}
    for how in ("plain", "checkpointed", "fit_flag"):
        out[how], out[how + "_weights"] = _train(index, processes, how, bn=False)
    out["plain_bn"] = _train(index, processes, "plain", bn=True)[0]
    out["checkpointed_bn"] = _train(index, processes, "checkpointed", bn=True)[0]
    return out


if __name__ == "__main__":
    print(json.dumps(_worker(int(sys.argv[1]), sys.argv[2])))
