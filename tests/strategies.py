"""Hypothesis strategies for random, valid Keras functional models.

A model is drawn as a `ModelSpec`: plain, immutable data that prints as
readable pseudo-code, so a shrunk failure shows its architecture. Then
`build_model(spec)` turns it into a Keras model, deterministically.

What the specs cover:
- 1 to 3 inputs, 1 to 3 outputs, each as a single tensor, a list or a dict;
  an output may be a model input, or the same tensor twice;
- tensors of three kinds: `vec` (batch, C), `seq` (batch, 5, C) and
  `img` (batch, 4, 4, C); convolutions keep the length (`padding="same"`);
- layers: Dense, Conv1D/Conv2D, BatchNormalization, LayerNormalization,
  Dropout, GaussianNoise, Activation, and reductions to `vec`
  (GlobalAveragePooling, Flatten);
- merges (Add, Multiply, Concatenate) of 2-3 tensors picked anywhere in the
  graph so far, so skip connections of any span, and the same tensor twice;
- a layer called again on another compatible tensor (shared weights, shared
  seed generator, BN statistics updated twice);
- a nested functional sub-model (1-2 inputs, 1-2 outputs, up to 4 calls)
  used as a layer, which may itself be called twice.

Shrinking goes toward chains: operand choices are drawn as "how far back",
and 0 means the latest tensor.
"""

import dataclasses

import keras
from hypothesis import strategies as st
from keras import layers

__all__ = ["TensorSpec", "LayerSpec", "Call", "ModelSpec", "model_specs", "build_model", "describe"]

SEQ_LEN = 5
IMG_SIZE = 4
MAX_CHANNELS = 24


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    kind: str  # "vec", "seq" or "img"
    channels: int

    @property
    def shape(self):
        return {"vec": (), "seq": (SEQ_LEN,), "img": (IMG_SIZE, IMG_SIZE)}[self.kind] + (self.channels,)

    def __str__(self):
        return f"{self.kind} {'x'.join(map(str, self.shape))}"


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    name: str
    cls: str
    kwargs: tuple = ()  # (key, value) pairs
    inner: "ModelSpec | None" = None  # for cls == "Model"

    def __str__(self):
        if self.inner is not None:
            return f"Model {self.name!r}"
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs)
        return f"{self.cls}({args})"


@dataclasses.dataclass(frozen=True)
class Call:
    layer: int  # index into ModelSpec.layers
    args: tuple  # tensor indices consumed
    outs: tuple  # tensor indices produced


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    tensors: tuple  # TensorSpec of every tensor: the inputs first
    num_inputs: int
    input_struct: str  # "single", "list" or "dict"
    layers: tuple  # LayerSpec
    calls: tuple  # Call, in order
    outputs: tuple  # tensor indices
    output_struct: str

    def __repr__(self):
        return "\n" + describe(self)

    def _repr_pretty_(self, printer, cycle):  # how hypothesis prints examples
        printer.text(repr(self))


MERGES = ("Add", "Multiply", "Concatenate")


def describe(spec, indent=""):
    """Readable pseudo-code of a spec, one line per tensor."""
    lines = []
    struct = spec.input_struct
    for i in range(spec.num_inputs):
        lines.append(f"{indent}t{i} = Input('x{i}')  # {spec.tensors[i]}")
    calls_so_far = {}
    for call in spec.calls:
        layer = spec.layers[call.layer]
        n = calls_so_far[call.layer] = calls_so_far.get(call.layer, 0) + 1
        outs = ", ".join(f"t{i}" for i in call.outs)
        args = ", ".join(f"t{i}" for i in call.args)
        if layer.cls in MERGES:
            args = f"[{args}]"
        head = f"{layer.name} = {layer}" if n == 1 else layer.name
        shapes = ", ".join(str(spec.tensors[i]) for i in call.outs)
        again = f"; shared: call {n} of {layer.name}" if n > 1 else ""
        lines.append(f"{indent}{outs} = {head}({args})  # {shapes}{again}")
        if layer.inner is not None and n == 1:
            lines.append(f"{indent}    where {layer.name} is:")
            lines.append(describe(layer.inner, indent + "        "))
    outs = [f"t{i}" for i in spec.outputs]
    if spec.output_struct == "dict":
        shown = "{" + ", ".join(f"'y{j}': {o}" for j, o in enumerate(outs)) + "}"
    elif spec.output_struct == "list":
        shown = "[" + ", ".join(outs) + "]"
    else:
        shown = outs[0]
    lines.append(f"{indent}return {shown}  # inputs as {struct}")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Drawing


def _back(draw, n):
    """An index into n items, drawn as the distance back from the last."""
    return n - 1 - draw(st.integers(0, n - 1))


def _pick(draw, candidates):
    """One of `candidates` (tensor indices), shrinking toward the latest."""
    candidates = sorted(candidates, reverse=True)
    return candidates[draw(st.integers(0, len(candidates) - 1))]


_ACTIVATIONS = ("relu", "tanh", "sigmoid", "gelu", "softplus", "linear")


class _Draft:
    """Mutable state while drawing one ModelSpec."""

    def __init__(self, inputs, prefix):
        self.tensors = list(inputs)
        self.num_inputs = len(inputs)
        self.layers = []
        self.calls = []
        self.first_args = {}  # layer index -> TensorSpecs of its first call's args
        self.prefix = prefix

    def add_layer(self, cls, kwargs=(), inner=None, name=None):
        name = name or f"{self.prefix}l{len(self.layers)}_{cls.lower()}"
        self.layers.append(LayerSpec(name, cls, tuple(kwargs), inner))
        return len(self.layers) - 1

    def call(self, layer, args, out_specs):
        outs = tuple(range(len(self.tensors), len(self.tensors) + len(out_specs)))
        self.tensors.extend(out_specs)
        self.calls.append(Call(layer, tuple(args), outs))
        self.first_args.setdefault(layer, tuple(self.tensors[i] for i in args))


def _unary(draw, draft):
    x = _back(draw, len(draft.tensors))
    t = draft.tensors[x]
    options = ["Dense", "Conv", "Activation", "BatchNormalization", "LayerNormalization", "Dropout", "GaussianNoise"]
    if t.kind != "vec":
        options.append("Reduce")
    cls = draw(st.sampled_from(options))
    out = t
    if cls == "Dense":
        units = draw(st.integers(1, 8))
        act = draw(st.sampled_from((None,) + _ACTIVATIONS))
        kwargs, out = (("units", units), ("activation", act)), TensorSpec(t.kind, units)
    elif cls == "Conv":
        if t.kind == "vec":  # no conv on vectors: a Dense instead
            cls, kwargs = "Dense", (("units", t.channels),)
        else:
            cls = "Conv1D" if t.kind == "seq" else "Conv2D"
            filters = draw(st.integers(1, 8))
            kwargs = (
                ("filters", filters),
                ("kernel_size", draw(st.integers(1, 3))),
                ("padding", "same"),
                ("activation", draw(st.sampled_from((None,) + _ACTIVATIONS))),
            )
            out = TensorSpec(t.kind, filters)
    elif cls == "Activation":
        kwargs = (("activation", draw(st.sampled_from(_ACTIVATIONS))),)
    elif cls == "Dropout":
        kwargs = (("rate", draw(st.sampled_from((0.5, 0.1, 0.3, 0.7)))),)
    elif cls == "GaussianNoise":
        kwargs = (("stddev", draw(st.sampled_from((0.5, 0.1, 1.0)))),)
    elif cls == "Reduce":
        flat = t.channels * (SEQ_LEN if t.kind == "seq" else IMG_SIZE * IMG_SIZE)
        use_flatten = flat <= 4 * MAX_CHANNELS and draw(st.booleans())
        if use_flatten:
            cls, out = "Flatten", TensorSpec("vec", flat)
        else:
            cls = "GlobalAveragePooling1D" if t.kind == "seq" else "GlobalAveragePooling2D"
            out = TensorSpec("vec", t.channels)
        kwargs = ()
    else:  # normalizations
        kwargs = ()
    draft.call(draft.add_layer(cls, kwargs), [x], [out])


def _merge(draw, draft):
    first = _back(draw, len(draft.tensors))
    t = draft.tensors[first]
    cls = draw(st.sampled_from(MERGES))
    if cls == "Concatenate":
        same = [i for i, u in enumerate(draft.tensors) if u.kind == t.kind]
    else:
        same = [i for i, u in enumerate(draft.tensors) if u == t]
    args = [first] + [_pick(draw, same) for _ in range(draw(st.integers(1, 2)))]
    channels = sum(draft.tensors[i].channels for i in args)
    if cls == "Concatenate" and channels > MAX_CHANNELS:
        cls = "Add"
        args = [i for i in args if draft.tensors[i] == t]
        if len(args) < 2:
            args.append(first)
    out = TensorSpec(t.kind, channels) if cls == "Concatenate" else t
    draft.call(draft.add_layer(cls), args, [out])


def _shared(draw, draft):
    """Calls an existing layer again, on tensors it accepts."""
    reusable = [i for i, layer in enumerate(draft.layers) if layer.cls not in MERGES]
    if not reusable:
        return _unary(draw, draft)
    layer = _pick(draw, reusable)
    want = draft.first_args[layer]
    args = [_pick(draw, [i for i, u in enumerate(draft.tensors) if u == w]) for w in want]
    first = next(c for c in draft.calls if c.layer == layer)
    draft.call(layer, args, [draft.tensors[i] for i in first.outs])


def _nested(draw, draft):
    n_args = draw(st.integers(1, 2))
    args = [_back(draw, len(draft.tensors)) for _ in range(n_args)]
    prefix = f"{draft.prefix}b{len(draft.layers)}_"
    inner = draw(_model_specs([draft.tensors[i] for i in args], max_calls=4, max_outputs=2, nesting=False, prefix=prefix))
    layer = draft.add_layer("Model", inner=inner, name=f"{prefix}block")
    draft.call(layer, args, [inner.tensors[i] for i in inner.outputs])


@st.composite
def _model_specs(draw, inputs, max_calls, max_outputs, nesting, prefix=""):
    draft = _Draft(inputs, prefix)
    kinds = ["unary"] * 5 + ["merge"] * 2 + ["shared"] * 2 + (["nested"] if nesting else [])
    for _ in range(draw(st.integers(1, max_calls))):
        {"unary": _unary, "merge": _merge, "shared": _shared, "nested": _nested}[draw(st.sampled_from(kinds))](draw, draft)
    n_out = draw(st.integers(1, max_outputs))
    outputs = [len(draft.tensors) - 1] + [_back(draw, len(draft.tensors)) for _ in range(n_out - 1)]
    top_level = not prefix
    structs = ["list", "dict"] if top_level else ["list"]
    in_struct = draw(st.sampled_from(["single"] + structs)) if len(inputs) == 1 else draw(st.sampled_from(structs))
    out_struct = draw(st.sampled_from(["single"] + structs)) if n_out == 1 else draw(st.sampled_from(structs))
    return ModelSpec(
        tensors=tuple(draft.tensors),
        num_inputs=len(inputs),
        input_struct=in_struct,
        layers=tuple(draft.layers),
        calls=tuple(draft.calls),
        outputs=tuple(outputs),
        output_struct=out_struct,
    )


tensor_specs = st.builds(TensorSpec, kind=st.sampled_from(("vec", "seq", "img")), channels=st.integers(1, 6))


@st.composite
def model_specs(draw, max_calls=30):
    """Strategy: a random valid functional model, as a `ModelSpec`."""
    inputs = draw(st.lists(tensor_specs, min_size=1, max_size=3))
    return draw(_model_specs(inputs, max_calls=max_calls, max_outputs=3, nesting=True))


# --------------------------------------------------------------------------
# Building


def _make_layer(spec):
    if spec.inner is not None:
        return build_model(spec.inner, name=spec.name)
    kwargs = dict(spec.kwargs)
    return getattr(layers, spec.cls)(name=spec.name, **kwargs)


def _pack(items, struct, prefix):
    if struct == "single":
        return items[0]
    if struct == "dict":
        return {f"{prefix}{i}": x for i, x in enumerate(items)}
    return list(items)


def build_model(spec, name="fuzz"):
    """The Keras functional model a `ModelSpec` describes."""
    prefix = name + "_" if name != "fuzz" else ""
    tensors = [
        keras.Input(spec.tensors[i].shape, name=f"{prefix}x{i}") for i in range(spec.num_inputs)
    ]
    inputs = list(tensors)
    objects = [_make_layer(layer) for layer in spec.layers]
    for call in spec.calls:
        layer, obj = spec.layers[call.layer], objects[call.layer]
        args = [tensors[i] for i in call.args]
        if layer.cls in MERGES:
            out = obj(args)
        elif layer.inner is not None:
            out = obj(_pack(args, layer.inner.input_struct, "x"))
        else:
            out = obj(args[0])
        out = keras.tree.flatten(out)
        assert len(out) == len(call.outs), (layer, out)
        for i, o in zip(call.outs, out):
            assert tuple(o.shape[1:]) == spec.tensors[i].shape, (layer, o.shape, spec.tensors[i])
        tensors.extend(out)
    outputs = [tensors[i] for i in spec.outputs]
    return keras.Model(_pack(inputs, spec.input_struct, "x"), _pack(outputs, spec.output_struct, "y"), name=name)
