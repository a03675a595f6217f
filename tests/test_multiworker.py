"""A checkpointed model trains multi-worker: two processes on this machine,
TensorFlow's `MultiWorkerMirroredStrategy` (gRPC collectives between the
workers, as between machines), each worker a fresh process run from this
file as a script.

Keras 3.15's `fit` fails under `MultiWorkerMirroredStrategy` before the
first step, for a plain model as much as a checkpointed one
(`_maybe_symbolic_build` reduces the first batch with `strategy.reduce`,
which raises on the (x, y) tuple of per-replica values). So the workers run
the custom training loop TensorFlow's multi-worker guide describes:
`strategy.run` of a `GradientTape` step over the distributed dataset, the
per-replica losses summed by `strategy.reduce`.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import BACKEND
from tests.test_distribute import WIDTH, _model  # the same 8-layer tanh chain

pytestmark = pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's MultiWorkerMirroredStrategy")

BATCH, STEPS, EPOCHS = 16, 4, 3


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _run(cluster):
    """Runs one worker per port in `cluster` (or one process without a
    cluster when it is empty) and returns each worker's JSON line."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__)))] + sys.path)
    ports = ",".join(map(str, cluster)) or "none"
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(i), ports], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for i in range(max(len(cluster), 1))
    ]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-4000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


@pytest.fixture(scope="module")
def runs():
    return _run(_free_ports(2)), _run([])[0]


def test_two_workers_train_the_checkpointed_model_as_the_plain_one(runs):
    workers, single = runs
    assert [w["replicas"] for w in workers] == [2, 2]
    for w in workers:
        # Same process, same collectives: the checkpointed model's steps are the plain model's.
        np.testing.assert_allclose(w["checkpointed"], w["plain"], rtol=1e-6)
        np.testing.assert_allclose(w["checkpointed_bn"], w["plain_bn"], rtol=1e-6)
        np.testing.assert_allclose(w["checkpointed_weights"], w["plain_weights"], rtol=1e-6)
    # All-reduced gradients: both workers hold the same trainable weights.
    np.testing.assert_allclose(workers[0]["checkpointed_weights"], workers[1]["checkpointed_weights"], rtol=1e-6)
    # Without BatchNorm (whose statistics are per replica), two workers on
    # half batches take the single process's steps on whole batches.
    np.testing.assert_allclose(workers[0]["checkpointed"], single["plain"], rtol=1e-5)
    assert workers[0]["checkpointed"][-1] < workers[0]["checkpointed"][0]


# ---------------------------------------------------------------- the worker


def _train(strategy, checkpoint, bn):
    """Loss per epoch and the trainable weights after training."""
    import keras
    import tensorflow as tf

    import graphckpt

    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, WIDTH)).astype("float32")
    y = rng.normal(size=(STEPS * BATCH, 2)).astype("float32")
    with strategy.scope():
        model = _model(bn)
        if checkpoint:
            model = graphckpt.checkpoint_model(model, segments=3)
            assert graphckpt.is_checkpointed(model)
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).with_options(options)
    data = strategy.experimental_distribute_dataset(data)

    @tf.function
    def step(xb, yb):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                # The global batch's mean: the replicas' sums add up to it.
                loss = tf.reduce_sum(tf.square(model(xb, training=True) - yb)) / (BATCH * 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return loss

        return strategy.reduce("SUM", strategy.run(replica_step, args=(xb, yb)), axis=None)

    history = []
    for _ in range(EPOCHS):
        history.append(sum(float(step(xb, yb)) for xb, yb in data) / STEPS)
    weights = np.concatenate([np.ravel(v.numpy()) for v in model.trainable_variables]).tolist()
    return history, weights


def _worker(index, ports):
    if ports != "none":
        cluster = {"worker": [f"localhost:{p}" for p in ports.split(",")]}
        os.environ["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
    import tensorflow as tf

    # Made before any other TensorFlow op, as the strategy requires.
    strategy = tf.distribute.MultiWorkerMirroredStrategy() if ports != "none" else tf.distribute.get_strategy()
    out = {"replicas": strategy.num_replicas_in_sync}
    out["plain"], out["plain_weights"] = _train(strategy, False, False)
    out["checkpointed"], out["checkpointed_weights"] = _train(strategy, True, False)
    out["plain_bn"] = _train(strategy, False, True)[0]
    out["checkpointed_bn"] = _train(strategy, True, True)[0]
    return out


if __name__ == "__main__":
    print(json.dumps(_worker(int(sys.argv[1]), sys.argv[2])))
