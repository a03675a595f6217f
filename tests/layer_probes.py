"""The layer probes: one small call of each layer class the estimator has a
rule for, and what the backend keeps for that call's backward pass.

`saved_bytes` measures, on the running Keras backend, the bytes a layer
call keeps for its backward pass, by what the backend itself records:

- PyTorch: every tensor autograd saves, through
  `torch.autograd.graph.saved_tensors_hooks` (each storage counted once).
- JAX: the residuals of `jax.vjp` over a stateless call of the layer (its
  output and its losses).
- TensorFlow: the tensors of a `tf.function`'s forward pass that the
  gradient's ops read (of the output and of the layer's losses), where
  those ops depend on the incoming gradient
  (the backward pass proper: an op such as `Shape` that does not runs in
  the forward pass and keeps nothing). A `while` loop (the recurrent
  layers) keeps its tensors in TensorLists, whose size the graph does not
  say: None.

The layer's weights, and anything that does not grow with the batch (a
transposed kernel), are left out by differencing two batch sizes. These are
exact counts, not allocator readings: the same on every run.

The probe table is also what `benchmarks/rule_probes.py` measures against
TensorFlow's allocator.
"""

import math

BATCHES = (4, 12)

# Input shapes (without the batch) by kind.
SHAPES = {
    "flat": (64, 128),  # elementwise layers: rank 3 keeps the carrier small
    "vec": (512,),
    "seq": (32, 64),
    "img": (16, 16, 32),
    "vol": (8, 8, 8, 16),
    "seq_img1": (8, 16, 16),  # ConvLSTM1D: time, length, channels
    "seq_img2": (6, 8, 8, 8),
    "seq_img3": (4, 6, 6, 6, 4),
    "ids": (32,),
}


def probes():
    """name -> (input kind, layer factory, how the layer is called: "one"
    on the carrier's output, "two" on two carriers' outputs, "pair" as
    `layer(a, b)`)."""
    import keras
    from keras import layers as L

    p = {
        "Dense": ("flat", lambda: L.Dense(128)),
        "EinsumDense": ("seq", lambda: L.EinsumDense("btd,de->bte", output_shape=(32, 64))),
        "Conv1D": ("seq", lambda: L.Conv1D(64, 3, padding="same")),
        "Conv2D": ("img", lambda: L.Conv2D(32, 3, padding="same")),
        "Conv3D": ("vol", lambda: L.Conv3D(16, 3, padding="same")),
        "Conv1DTranspose": ("seq", lambda: L.Conv1DTranspose(64, 3, padding="same")),
        "Conv2DTranspose": ("img", lambda: L.Conv2DTranspose(32, 3, padding="same")),
        "Conv3DTranspose": ("vol", lambda: L.Conv3DTranspose(16, 3, padding="same")),
        "DepthwiseConv1D": ("seq", lambda: L.DepthwiseConv1D(3, padding="same")),
        "DepthwiseConv2D": ("img", lambda: L.DepthwiseConv2D(3, padding="same")),
        "SeparableConv1D": ("seq", lambda: L.SeparableConv1D(64, 3, padding="same")),
        "SeparableConv2D": ("img", lambda: L.SeparableConv2D(32, 3, padding="same")),
        "MultiHeadAttention": ("seq", lambda: L.MultiHeadAttention(4, 16), "pair"),
        "GroupQueryAttention": ("seq", lambda: L.GroupQueryAttention(16, 4, 2), "pair"),
        "Attention": ("seq", lambda: L.Attention(), "two"),
        "AdditiveAttention": ("seq", lambda: L.AdditiveAttention(), "two"),
        "LSTM": ("seq", lambda: L.LSTM(64, return_sequences=True)),
        "GRU": ("seq", lambda: L.GRU(64, return_sequences=True)),
        "SimpleRNN": ("seq", lambda: L.SimpleRNN(64, return_sequences=True)),
        "ConvLSTM1D": ("seq_img1", lambda: L.ConvLSTM1D(16, 3, padding="same", return_sequences=True)),
        "ConvLSTM2D": ("seq_img2", lambda: L.ConvLSTM2D(8, 3, padding="same", return_sequences=True)),
        "ConvLSTM3D": ("seq_img3", lambda: L.ConvLSTM3D(4, 3, padding="same", return_sequences=True)),
        "Bidirectional": ("seq", lambda: L.Bidirectional(L.LSTM(32, return_sequences=True))),
        "TimeDistributed": ("seq", lambda: L.TimeDistributed(L.Dense(64))),
        "Dropout": ("flat", lambda: L.Dropout(0.5)),
        "SpatialDropout1D": ("seq", lambda: L.SpatialDropout1D(0.5)),
        "SpatialDropout2D": ("img", lambda: L.SpatialDropout2D(0.5)),
        "SpatialDropout3D": ("vol", lambda: L.SpatialDropout3D(0.5)),
        "AlphaDropout": ("flat", lambda: L.AlphaDropout(0.5)),
        "GaussianDropout": ("flat", lambda: L.GaussianDropout(0.5)),
        "BatchNormalization": ("img", lambda: L.BatchNormalization()),
        "LayerNormalization": ("seq", lambda: L.LayerNormalization()),
        "GroupNormalization": ("img", lambda: L.GroupNormalization(4)),
        "UnitNormalization": ("seq", lambda: L.UnitNormalization()),
        "RMSNormalization": ("seq", lambda: L.RMSNormalization()),
        "ReLU": ("flat", lambda: L.ReLU()),
        "ELU": ("flat", lambda: L.ELU()),
        "Softmax": ("seq", lambda: L.Softmax()),
        "Activation": ("flat", lambda: L.Activation("gelu")),
        "Add": ("flat", lambda: L.Add(), "two"),
        "Subtract": ("flat", lambda: L.Subtract(), "two"),
        "Average": ("flat", lambda: L.Average(), "two"),
        "Concatenate": ("flat", lambda: L.Concatenate(), "two"),
        "Multiply": ("flat", lambda: L.Multiply(), "two"),
        "Maximum": ("flat", lambda: L.Maximum(), "two"),
        "Minimum": ("flat", lambda: L.Minimum(), "two"),
        "Dot": ("seq", lambda: L.Dot(axes=(2, 2)), "two"),
        "Reshape": ("seq", lambda: L.Reshape((64, 32))),
        "Flatten": ("seq", lambda: L.Flatten()),
        "Permute": ("seq", lambda: L.Permute((2, 1))),
        "RepeatVector": ("vec", lambda: L.RepeatVector(3)),
        "Identity": ("flat", lambda: L.Identity()),
        "ZeroPadding1D": ("seq", lambda: L.ZeroPadding1D(2)),
        "ZeroPadding2D": ("img", lambda: L.ZeroPadding2D(2)),
        "ZeroPadding3D": ("vol", lambda: L.ZeroPadding3D(1)),
        "Cropping1D": ("seq", lambda: L.Cropping1D(2)),
        "Cropping2D": ("img", lambda: L.Cropping2D(2)),
        "Cropping3D": ("vol", lambda: L.Cropping3D(1)),
        "UpSampling1D": ("seq", lambda: L.UpSampling1D(2)),
        "UpSampling2D": ("img", lambda: L.UpSampling2D(2)),
        "UpSampling3D": ("vol", lambda: L.UpSampling3D(2)),
        "AveragePooling1D": ("seq", lambda: L.AveragePooling1D(2)),
        "AveragePooling2D": ("img", lambda: L.AveragePooling2D(2)),
        "AveragePooling3D": ("vol", lambda: L.AveragePooling3D(2)),
        "GlobalAveragePooling1D": ("seq", lambda: L.GlobalAveragePooling1D()),
        "GlobalAveragePooling2D": ("img", lambda: L.GlobalAveragePooling2D()),
        "GlobalAveragePooling3D": ("vol", lambda: L.GlobalAveragePooling3D()),
        "MaxPooling1D": ("seq", lambda: L.MaxPooling1D(2)),
        "MaxPooling2D": ("img", lambda: L.MaxPooling2D(2)),
        "MaxPooling3D": ("vol", lambda: L.MaxPooling3D(2)),
        "GlobalMaxPooling1D": ("seq", lambda: L.GlobalMaxPooling1D()),
        "GlobalMaxPooling2D": ("img", lambda: L.GlobalMaxPooling2D()),
        "GlobalMaxPooling3D": ("vol", lambda: L.GlobalMaxPooling3D()),
        "GaussianNoise": ("flat", lambda: L.GaussianNoise(0.5)),
        "Rescaling": ("img", lambda: L.Rescaling(0.5)),
        "Resizing": ("img", lambda: L.Resizing(12, 12)),
        "CenterCrop": ("img", lambda: L.CenterCrop(12, 12)),
        "Embedding": ("ids", lambda: L.Embedding(100, 64)),
        "Masking": ("flat", lambda: L.Masking()),
        "ActivityRegularization": ("flat", lambda: L.ActivityRegularization(l1=0.01)),
        "PReLU": ("flat", lambda: L.PReLU()),
        "LeakyReLU": ("flat", lambda: L.LeakyReLU()),
        "Normalization": ("flat", lambda: L.Normalization(mean=0.0, variance=1.0)),
    }
    p.update(op_probes())
    if hasattr(L, "ReversibleEmbedding"):
        p["ReversibleEmbedding"] = ("ids", lambda: L.ReversibleEmbedding(100, 64))
    try:
        import keras_hub  # noqa: F401
        from keras_hub.src.layers.modeling import (
            position_embedding,
            rms_normalization,
            rotary_embedding,
        )
        from keras_hub.src.layers.modeling import token_and_position_embedding as tpe
        from keras_hub.src.models.llama.llama_attention import LlamaAttention
    except ImportError:
        return p
    p["keras_hub.RMSNormalization"] = ("seq", lambda: rms_normalization.RMSNormalization(64))
    p["keras_hub.PositionEmbedding"] = ("seq", lambda: position_embedding.PositionEmbedding(32), "add")
    p["keras_hub.RotaryEmbedding"] = ("seq", lambda: rotary_embedding.RotaryEmbedding())
    p["keras_hub.TokenAndPositionEmbedding"] = ("ids", lambda: tpe.TokenAndPositionEmbedding(100, 32, 64))
    p["keras_hub.LlamaAttention"] = ("seq", lambda: LlamaAttention(4, 2, rope_max_wavelength=10000))
    del keras
    return p




class Op:
    """A Keras op as a probe's "layer": called on tensors, it records an op
    node (as in a composite layer's opened graph); it has no weights."""

    built = True

    def __init__(self, fn):
        self.fn = fn
        self.weights, self.trainable_variables, self.non_trainable_variables = [], [], []
        self.trainable_weights, self.losses = [], []

    def __call__(self, *args, training=None):
        return self.fn(*args)


def op_probes():
    """The Keras ops that opened attention and transformer blocks call
    (Keras's MultiHeadAttention, keras_hub's decoders), as probes named
    `op.<name>`."""
    from keras import ops

    return {
        "op.einsum": ("seq", lambda: Op(lambda a, b: ops.einsum("bqd,bkd->bqk", a, b)), "pair"),
        "op.matmul": ("seq", lambda: Op(lambda a, b: ops.matmul(a, ops.transpose(b, (0, 2, 1)))), "pair"),
        "op.multiply": ("flat", lambda: Op(ops.multiply), "pair"),
        "op.multiply_scalar": ("flat", lambda: Op(lambda a: ops.multiply(a, 0.5))),
        "op.add": ("flat", lambda: Op(ops.add), "pair"),
        "op.minimum": ("flat", lambda: Op(ops.minimum), "pair"),
        "op.softmax": ("seq", lambda: Op(lambda a: ops.softmax(a, axis=-1))),
        "op.gelu": ("flat", lambda: Op(ops.gelu)),
        "op.tanh": ("flat", lambda: Op(ops.tanh)),
        "op.reshape": ("seq", lambda: Op(lambda a: ops.reshape(a, (-1, 32, 4, 16)))),
        "op.transpose": ("seq", lambda: Op(lambda a: ops.transpose(a, (0, 2, 1)))),
    }


def _input_count(how):
    """How many tensors a probe's layer is called on."""
    return 2 if how in ("two", "pair") else 1


def make_inputs(kind, how, batch, rng):
    """Random numpy inputs for a probe: one, or two for a layer of two."""
    shape = SHAPES[kind]
    if kind == "ids":
        return [rng.integers(0, 100, (batch,) + shape).astype("int32")]
    return [rng.normal(size=(batch,) + shape).astype("float32") for _ in range(_input_count(how))]


def call(layer, xs, how):
    """Calls `layer` on `xs` as the probe says, in training mode."""
    if how == "two":
        return layer(list(xs), training=True)
    if how == "pair":
        return layer(xs[0], xs[1], training=True)
    return layer(xs[0], training=True)


def _torch_saved(layer, xs, how):
    import torch

    weights = {v.value.untyped_storage().data_ptr() for v in layer.weights}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tensors = [torch.tensor(x, requires_grad=x.dtype.kind == "f") for x in xs]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call(layer, tensors, how)
    return sum(saved.values())


def _jax_saved(layer, xs, how):
    import jax
    import keras

    variables = list(layer.trainable_variables)
    others = [(v, v.value) for v in layer.non_trainable_variables]
    floats = [i for i, x in enumerate(xs) if x.dtype.kind == "f"]

    def f(values, float_xs):
        args = list(xs)
        for i, x in zip(floats, float_xs):
            args[i] = x
        # `__call__` under a stateless scope, as the JAX trainer calls layers
        # (`stateless_call` runs `call` alone, without activity regularizers).
        state = list(zip(variables, values)) + others
        with keras.StatelessScope(state_mapping=state, collect_losses=True) as scope:
            out = call(layer, args, how)
        return out, sum(scope.losses)  # activity regularization joins the loss

    values = [v.value for v in variables]
    _, vjp = jax.vjp(f, values, [jax.numpy.asarray(xs[i]) for i in floats])
    weights = {id(w) for w in values + [value for _, value in others]}
    leaves = {id(leaf): leaf.nbytes for leaf in jax.tree_util.tree_leaves(vjp) if hasattr(leaf, "nbytes")}
    return sum(n for i, n in leaves.items() if i not in weights)


def _tensorflow_saved(layer, xs, how):
    import tensorflow as tf

    constants = [tf.constant(x) for x in xs]
    floats = [i for i, x in enumerate(xs) if x.dtype.kind == "f"]

    @tf.function
    def step(dy, *float_xs):
        args = list(constants)
        for i, x in zip(floats, float_xs):
            args[i] = x
        with tf.GradientTape() as tape:
            tape.watch(list(float_xs))
            y = call(layer, args, how)
            losses = list(layer.losses)  # activity regularization joins the loss
        targets = [y] + losses
        seeds = [dy] + [tf.ones_like(loss) for loss in losses]
        return tape.gradient(targets, list(float_xs) + layer.trainable_weights, output_gradients=seeds)

    y = call(layer, constants, how)
    graph = step.get_concrete_function(tf.zeros_like(y), *[constants[i] for i in floats]).graph
    after = {}  # op -> the ops that consume its outputs or wait for it
    for op in graph.get_operations():
        for before in [t.op for t in op.inputs] + list(op.control_inputs):
            after.setdefault(before, []).append(op)
    backward, todo = set(), [graph.inputs[0].op]  # what depends on dy
    while todo:
        op = todo.pop()
        if op not in backward:
            backward.add(op)
            todo.extend(after.get(op, ()))
    saved = {}
    for op in graph.get_operations():
        if op in backward or op.type in ("ReadVariableOp", "VarHandleOp"):
            continue
        for t in op.outputs:
            if not any(c in backward for c in t.consumers()):
                continue
            if t.dtype in (tf.variant, tf.resource):
                return None  # a while loop's TensorLists
            if t.dtype.is_floating or t.dtype.is_bool:
                saved[t.name] = t.shape.num_elements() * t.dtype.size
    return sum(saved.values())


def saved_bytes(layer, xs, how):
    """Bytes the running backend keeps for the backward pass of one call of
    `layer` on `xs` (weights left out), or None where it cannot tell."""
    import keras

    measure = {"torch": _torch_saved, "jax": _jax_saved, "tensorflow": _tensorflow_saved}
    return measure[keras.backend.backend()](layer, xs, how)


def measured_per_example(spec, rng):
    """Per-example bytes a call keeps for backward on the running backend,
    differenced over `BATCHES`; None where the backend cannot tell."""
    kind, factory, how = (*spec, "one")[:3]
    layer = factory()
    counts = []
    for batch in BATCHES:
        xs = make_inputs(kind, how, batch, rng)
        if not layer.built:
            call(layer, xs, how)
        counts.append(saved_bytes(layer, xs, how))
    if None in counts:
        return None
    return (counts[1] - counts[0]) / (BATCHES[1] - BATCHES[0])


def estimated_per_example(spec):
    """(per-example bytes the estimator says the call keeps for backward,
    the call's float input and output bytes), from a model of that call."""
    import keras

    from graphckpt.estimator.peak import node_costs
    from graphckpt.graph.build import build_graph

    kind, factory, how = (*spec, "one")[:3]
    dtype = "int32" if kind == "ids" else "float32"
    inputs = [keras.Input(SHAPES[kind], dtype=dtype) for _ in range(_input_count(how))]
    model = keras.Model(inputs, call(factory(), inputs, how))
    graph = build_graph(model)
    costs = node_costs(graph)
    kept = sum(costs.internal.values()) + sum(costs.tensor_bytes[k] for k in costs.saved)
    tensors = graph.tensors
    io = sum(
        4 * math.prod(tensors[k].shape[1:]) for k in graph.inputs + graph.outputs
        if "float" in tensors[k].dtype
    )
    return kept, io
