"""A checkpointed model trains under the data-parallel engines users already
have, on two CPU devices:

- TensorFlow `tf.distribute.MirroredStrategy` over two logical CPU devices;
- JAX `keras.distribution.DataParallel` over two host devices, and
  `keras.distribution.ModelParallel` with every Dense kernel and bias split
  across them (how keras_hub shards Gemma for LoRA fine-tuning).

The device layout is fixed when the backend initializes, so each run is a
fresh subprocess: this file, run as a script. The worker prints one JSON line
of loss histories; the tests compare them.
"""

import functools
import json
import os
import subprocess
import sys

WIDTH, BATCH, EPOCHS = 16, 16, 3


@functools.cache
def _run_worker(engine):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env["KERAS_BACKEND"] = {"mirrored": "tensorflow", "jax": "jax"}[engine]
    if engine == "jax":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    proc = subprocess.run(
        [sys.executable, __file__, engine], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_mirrored_strategy_two_cpus():
    out = _run_worker("mirrored")
    assert out["replicas"] == 2
    # Same global batch: the all-reduced step equals the single-device step.
    _close(out["mirrored_checkpointed"], out["single_plain"], rtol=1e-4)
    _close(out["mirrored_checkpointed"], out["mirrored_plain"], rtol=1e-5)
    # BatchNormalization per replica: exactly what the plain model does there.
    _close(out["mirrored_checkpointed_bn"], out["mirrored_plain_bn"], rtol=1e-5)
    assert out["mirrored_checkpointed"][-1] < out["mirrored_checkpointed"][0]


def test_jax_data_parallel_two_host_devices():
    out = _run_worker("jax")
    assert out["devices"] == 2
    assert out["batch_shards"] == 2
    _close(out["parallel_checkpointed"], out["single_plain"], rtol=1e-4)
    _close(out["parallel_checkpointed"], out["parallel_plain"], rtol=1e-5)
    _close(out["parallel_checkpointed_bn"], out["single_plain_bn"], rtol=1e-4)
    assert out["parallel_checkpointed"][-1] < out["parallel_checkpointed"][0]


def test_jax_model_parallel_weights_split_across_two_host_devices():
    out = _run_worker("jax")
    assert out["split_weights"] == 2 * 9  # every Dense kernel and bias, sharded on "model"
    _close(out["sharded_checkpointed"], out["sharded_plain"], rtol=1e-5)
    _close(out["sharded_checkpointed"], out["single_plain"], rtol=1e-4)


def test_jax_model_parallel_gemma_lora_through_the_fit_flag():
    """keras_hub's GemmaCausalLM with LoRA and Dropout, its weights split
    by `GemmaBackbone.get_layout_map`: the fit flag trains it as plain
    `fit` does (weights equal to rounding: JAX's fused programs differ)."""
    out = _run_worker("jax")
    assert out["gemma_split"] >= 10
    assert out["gemma_segments_run"] == [True] * 3
    _close(out["gemma_flag"], out["gemma_plain"], rtol=1e-5)
    assert out["gemma_weight_diff"] < 1e-5


def _close(actual, expected, rtol):
    import numpy as np

    assert len(actual) == len(expected) == EPOCHS
    np.testing.assert_allclose(actual, expected, rtol=rtol)


# ---------------------------------------------------------------- the worker


def _model(bn):
    import keras
    from keras import layers

    keras.utils.set_random_seed(7)
    inp = keras.Input((WIDTH,))
    x = inp
    for i in range(8):
        x = layers.Dense(WIDTH, activation="tanh")(x)
        if bn and i % 3 == 2:
            x = layers.BatchNormalization()(x)
    return keras.Model(inp, layers.Dense(2)(x))


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * BATCH, WIDTH)).astype("float32")
    y = rng.normal(size=(4 * BATCH, 2)).astype("float32")
    return x, y


def _fit(scope, checkpoint, bn=False):
    import graphckpt

    x, y = _data()
    with scope:
        model = _model(bn)
        if checkpoint:
            model = graphckpt.checkpoint_model(model, segments=3)
            assert graphckpt.is_checkpointed(model)
        model.compile(optimizer="sgd", loss="mse")
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model, [float(v) for v in history.history["loss"]]


def _mirrored():
    import contextlib

    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(devices)
    out = {"replicas": strategy.num_replicas_in_sync}
    out["single_plain"] = _fit(contextlib.nullcontext(), False)[1]
    out["mirrored_plain"] = _fit(strategy.scope(), False)[1]
    out["mirrored_checkpointed"] = _fit(strategy.scope(), True)[1]
    out["mirrored_plain_bn"] = _fit(strategy.scope(), False, bn=True)[1]
    out["mirrored_checkpointed_bn"] = _fit(strategy.scope(), True, bn=True)[1]
    return out


def _jax():
    import contextlib

    import jax
    import keras
    import numpy as np

    devices = jax.devices()
    parallel = keras.distribution.DataParallel(devices=devices)
    out = {"devices": len(devices)}
    out["batch_shards"] = len(parallel.get_data_layout((BATCH, WIDTH)).device_mesh.devices.flatten())
    out["single_plain"] = _fit(contextlib.nullcontext(), False)[1]
    out["single_plain_bn"] = _fit(contextlib.nullcontext(), False, bn=True)[1]
    out["parallel_plain"] = _fit(parallel.scope(), False)[1]
    model, out["parallel_checkpointed"] = _fit(parallel.scope(), True)
    assert all(len(v.value.sharding.device_set) == len(devices) for v in model.trainable_variables)
    out["parallel_checkpointed_bn"] = _fit(parallel.scope(), True, bn=True)[1]

    mesh = keras.distribution.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
    layout = keras.distribution.LayoutMap(mesh)
    layout["dense.*kernel"] = (None, "model")
    layout["dense.*bias"] = ("model",)
    sharded = keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch")
    out["sharded_plain"] = _fit(sharded.scope(), False)[1]
    model, out["sharded_checkpointed"] = _fit(sharded.scope(), True)
    out["split_weights"] = sum(_split(v) for v in model.trainable_variables)

    import keras_hub

    gemma = keras.distribution.ModelParallel(
        layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh), batch_dim_name="batch"
    )
    plain, out["gemma_plain"] = _gemma_lora(gemma, None)
    flagged, out["gemma_flag"] = _gemma_lora(gemma, 3)
    out["gemma_split"] = sum(_split(v) for v in flagged.weights)
    from graphckpt.training.flag import _CACHE_ATTR

    (twin,) = flagged.__dict__[_CACHE_ATTR].twins.values()
    out["gemma_segments_run"] = [s.forward_calls >= 2 for s in twin.segments]  # forward and recompute traced
    out["gemma_weight_diff"] = max(
        float(np.max(np.abs(keras.ops.convert_to_numpy(a) - keras.ops.convert_to_numpy(b))))
        for a, b in zip(flagged.weights, plain.weights)
    )
    return out


def _split(variable):
    spec = getattr(variable.value.sharding, "spec", ())
    return "model" in tuple(spec)


def _gemma_lora(distribution, flag):
    """A small GemmaCausalLM with LoRA and Dropout, its weights split as
    keras_hub's layout map splits them, trained with the fit flag (`flag`
    segments) or without (None)."""
    import keras
    import keras_hub
    import numpy as np

    import graphckpt

    rng = np.random.default_rng(1)
    x = {"token_ids": rng.integers(1, 64, (8, 16)).astype("int32"), "padding_mask": np.ones((8, 16), "bool")}
    y = rng.integers(1, 64, (8, 16)).astype("int32")
    graphckpt.install()
    try:
        with distribution.scope():
            keras.utils.set_random_seed(0)
            backbone = keras_hub.models.GemmaBackbone(
                vocabulary_size=64, num_layers=3, num_query_heads=2, num_key_value_heads=2, hidden_dim=16,
                intermediate_dim=32, head_dim=8, dropout=0.1,
            )
            lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
            lm.backbone.enable_lora(4)
            lm.compile(optimizer=keras.optimizers.Adam(1e-2))
            keras.utils.set_random_seed(1)  # the same Dropout masks
            history = lm.fit(x, y, batch_size=4, epochs=EPOCHS, shuffle=False, verbose=0, gradient_checkpointing=flag)
    finally:
        graphckpt.uninstall()
    return lm, [float(v) for v in history.history["loss"]]


if __name__ == "__main__":
    result = {"mirrored": _mirrored, "jax": _jax}[sys.argv[1]]()
    print(json.dumps(result))
