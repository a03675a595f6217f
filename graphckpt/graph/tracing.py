"""Tracing a subclassed model's `call` into a functional graph of its parts.

A `keras.Model` subclass keeps its graph in Python: `call` calls layers and
`keras.ops`. Called on symbolic inputs, `type(model).call(model, inputs,
training=True)` records each of those calls as a node: a `Functional` over
the model's own layer objects and variables, which graphckpt plans and
rewrites as it does any functional model. The fit flag then routes the
model's training calls through the checkpointed graph (`graphckpt.training.flag`),
so the user's object, its `train_step` and its `compile` stay in charge.

A trace stands in for `call` only where it computes the same thing; it is
refused, with the construct and where it is, where it cannot:

- the model holds variables or seed generators itself (its `call` reads
  or assigns them outside any layer; Keras itself refuses variables
  created in `call` once the model is built);
- `call` draws random numbers outside a layer (`keras.random.*`: a draw
  while tracing would be frozen into the graph as a constant);
- Python control flow on a tensor's value, or arithmetic on a dimension the
  data leaves unknown (the trace fails: `where` names the line);
- the traced graph computes other outputs, losses or gradients than
  `call` on a small batch from the same seed state (`opening.same_values`):
  a layer called on values that don't come from the inputs, for example,
  whose variables would then not train.

The trace is made for training (`training=True` where `call` takes it) and
for the data's shapes and dtypes, batch dimension free where `call`
allows; losses `call` adds itself (`self.add_loss(...)`) become extra
outputs, handed back to the model by the caller (`Traced.split`).
"""

import inspect
import os
import traceback
import warnings
from typing import NamedTuple

import keras
from keras import tree

from graphckpt import errors, keras_compat
from graphckpt.graph import opening

__all__ = ["Traced", "trace_model", "is_subclassed", "nested_models", "warn_untraced_call"]

_CACHE_ATTR = "_graphckpt_traced"  # on the model: {signature: Traced}


class Traced(NamedTuple):
    """A traced `call`. `functional` maps the model's inputs to the flat
    list of `call`'s outputs followed by the losses `call` added itself;
    `structure` is the outputs' structure, `num_losses` how many losses."""

    functional: keras.Model
    structure: object
    num_losses: int

    def split(self, flat):
        """`(outputs, losses)` from what `functional` returned."""
        flat = list(flat) if isinstance(flat, (list, tuple)) else [flat]
        n = len(flat) - self.num_losses
        return tree.pack_sequence_as(self.structure, flat[:n]), flat[n:]


is_subclassed = opening.is_subclassed


def nested_models(layer):
    """The `open_layers` predicate the fit flag plans a traced model with
    when the user asked for none: subclassed models called inside it are
    traced (opened) too, composite layers stay whole."""
    return is_subclassed(layer)


def trace_model(model, batch):
    """The `Traced` graph of `model.call` in training, for inputs like
    `batch` (a structure of `KerasTensor`s: the data's first batch), cached
    on the model per signature.

    Raises:
        graphckpt.UnsupportedModelError: `call` cannot be traced exactly;
            the message names the construct, and the line where the trace
            failed.
    """
    cache = model.__dict__.get(_CACHE_ATTR)
    if cache is None:
        cache = {}
        object.__setattr__(model, _CACHE_ATTR, cache)
    key = repr(tree.map_structure(lambda t: (tuple(t.shape), t.dtype), batch))
    if key not in cache:
        with opening.random_state_kept():
            cache[key] = _trace_and_check(model, batch)
    return cache[key]


def warn_untraced_call(model, kwargs):
    """Warns that a training call of `model` with arguments besides its
    inputs and `training` (`kwargs`), which its trace was not made for,
    runs its own `call`, without checkpointing."""
    given = sorted(k for k, v in kwargs.items() if k != "training" and v is not None)
    warnings.warn(
        f"Model '{model.name}': a training call with arguments its traced `call` was not made for "
        f"({', '.join(given) or 'more than one positional input'}) runs without gradient checkpointing.",
        errors.GraphckptWarning,
        stacklevel=4,
    )


def _refuse(model, what, tip):
    return errors.UnsupportedModelError(
        f"Model '{model.name}' of class {type(model).__name__}: `fit(gradient_checkpointing=...)` "
        f"traces its `call` into a graph of layer calls, and {what}. Expected a `call` that only "
        f"calls layers and `keras.ops` on its inputs. Tip: {tip}, or fit without the flag."
    )


_LAYER_TIP = "move it into a layer of its own (a `keras.layers.Layer` whose `call` does it), which stays one node"


def _trace_and_check(model, batch):
    seeds_before = _seed_states(model)
    traced, error = None, None
    for free_batch in (True, False):  # batch dimension free, else the data's
        try:
            traced = _trace(model, batch, free_batch)
            break
        except Exception as e:  # noqa: BLE001 - a failed trace is refused, below
            error = error or e
    if traced is None:
        raise _refuse(model, f"the trace failed {_where(error)}: {_kind(error)}", _tip(error)) from None
    if _captures_a_graph(traced.functional):
        raise _refuse(model, _CONSTANT, _LAYER_TIP)
    own = opening.own_state(model)
    if own:
        names = ", ".join(getattr(v, "path", getattr(v, "name", "?")) for v in own[:3])
        raise _refuse(
            model,
            f"the model holds variables or seed generators itself ({names}), which `call` would read or "
            "assign outside the graph",
            _LAYER_TIP,
        )
    if _drew(seeds_before, _seed_states(model)):
        raise _refuse(
            model,
            "`call` draws random numbers outside a layer (`keras.random.*`): the trace would freeze one draw",
            _LAYER_TIP + " with a `keras.random.SeedGenerator`",
        )
    try:
        differs = _verify(model, batch, traced)
    except Exception as e:  # noqa: BLE001 - a graph that can't be run is refused
        differs = f"results (running it failed: {type(e).__name__}: {str(e).splitlines()[0][:120]})"
    if differs:
        raise _refuse(
            model,
            f"the traced graph computes other {differs} than `call` on a small batch ({_CONSTANT}, or "
            "`call` reads state outside its layers)",
            _LAYER_TIP,
        )
    return traced


def _trace(model, batch, free_batch):
    def symbolic(t, name=None):
        return keras.Input(batch_shape=(None if free_batch else t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, name=name)

    if isinstance(batch, dict) and all(isinstance(t, keras.KerasTensor) for t in batch.values()):
        inputs = {k: symbolic(t, name=k) for k, t in batch.items()}  # named as the data's keys, which plans read
    else:
        inputs = tree.map_structure(symbolic, batch)
    kwargs = {"training": True} if "training" in inspect.signature(model.call).parameters else {}
    losses = []

    def add_loss(loss):  # `call`'s own `self.add_loss(...)`: an output of the graph
        losses.extend(tree.flatten(loss))

    object.__setattr__(model, "add_loss", add_loss)
    try:
        structure = []

        def call():
            outputs = type(model).call(model, opening.cast_inputs(model, inputs), **kwargs)
            structure.append(outputs)
            return [*tree.flatten(outputs), *losses]

        functional = opening.record(model, inputs, call)
    finally:
        del model.__dict__["add_loss"]
    return Traced(functional, structure[0], len(losses))


_CONSTANT = (
    "a layer is called on values that do not come from the inputs (such as `ops.arange`): the trace "
    "keeps its result as a constant, and its variables would not train"
)


def _captures_a_graph(functional):
    """Whether a call in `functional` takes a tensor that is not one of its
    symbolic tensors but was computed from variables while tracing (on
    PyTorch it still carries their autograd graph): a layer called on
    values that don't come from the inputs."""
    for node in keras_compat.nodes_of(functional):
        arguments = tree.flatten((node.arguments.args, node.arguments.kwargs))
        if any(not isinstance(a, keras.KerasTensor) and getattr(a, "requires_grad", False) for a in arguments):
            return True
    return False


def _seed_states(model):
    """`{id: (generator, state as bytes)}` for the global seed generator and
    each seed generator in `model`."""
    generators = keras_compat.seed_generators(model)
    found = keras_compat.global_attribute("global_seed_generator")
    generators += [found] if found is not None else []
    return {id(g): (g, keras.ops.convert_to_numpy(g.state.value)) for g in generators}


def _drew(before, after):
    """Whether a seed generator moved between the states `before` and
    `after` (`_seed_states`): one that existed before changed, or one made
    since has drawn (its counter, which starts at 0, moved)."""
    for key, (_, state) in after.items():
        old = before.get(key)
        if (old is not None and old[1].tobytes() != state.tobytes()) or (old is None and int(state[-1]) != 0):
            return True
    return False


def _verify(model, batch, traced):
    """What `traced` computes otherwise than `model(x, training=True)` on a
    small batch (its outputs, the sum of its losses, their gradients), or
    None."""
    xs = tree.pack_sequence_as(batch, [opening.small_batch(t.shape, t.dtype, i) for i, t in enumerate(tree.flatten(batch))])

    def total(losses):
        return sum((keras.ops.cast(loss, "float32") for loss in losses), keras.ops.convert_to_tensor(0.0))

    def want():
        outputs = model(xs, training=True)
        return [*tree.flatten(outputs), total(model.losses)]

    def got():
        outputs, losses = traced.split(traced.functional(xs, training=True))
        return [*tree.flatten(outputs), total(losses) + total(traced.functional.losses)]

    return opening.same_values(model, want, got)


def _where(error):
    """`at <file>:<line> (<code>)` for the last frame of `error`'s
    traceback outside Keras, graphckpt and the backends: the user's line."""
    skip = (os.sep + "keras" + os.sep, os.sep + "graphckpt" + os.sep, "site-packages", "dist-packages")
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not any(s in f.filename for s in skip)]
    if not frames:
        return ""
    f = frames[-1]
    return f"at {os.path.basename(f.filename)}:{f.lineno} (`{(f.line or '').strip()}`)"


def _kind(error):
    text = str(error).splitlines()[0][:200] if str(error) else ""
    if "as a boolean" in text or "bool" in text.lower() and "KerasTensor" in text:
        return f"Python control flow on a tensor's value ({text})"
    if "NoneType" in text:
        return f"arithmetic on a dimension the data leaves unknown ({type(error).__name__}: {text})"
    return f"{type(error).__name__}: {text}"


def _tip(error):
    if "as a boolean" in str(error):
        return "branch with `keras.ops.cond` or `keras.ops.where`, or move the branch into a layer of its own"
    return _LAYER_TIP
