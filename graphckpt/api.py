"""Public entry points: `checkpoint_model` and `plan`.

Arguments are checked here, once, and every failure becomes one
`GraphckptError` that names what was received and what to do.
"""

import warnings

import keras

from graphckpt import errors
from graphckpt.graph import build_graph, functional_of
from graphckpt.plan import plan_segments
from graphckpt.rewrite import rewrite
from graphckpt.segment import Segment

__all__ = ["checkpoint_model", "plan", "is_checkpointed"]


def is_checkpointed(model):
    """True if `model` already contains graphckpt segments."""
    return isinstance(model, keras.Model) and any(isinstance(layer, Segment) for layer in model.layers)


def _check_model(model):
    if not isinstance(model, keras.Model):
        raise errors.NotAModelError(
            "graphckpt rewrites Keras models. Received: "
            f"model={model!r} of type {type(model).__name__}. "
            "Tip: pass a built functional `keras.Model` or `keras.Sequential`."
        )
    if isinstance(model, keras.Sequential):
        if not model.built or functional_of(model) is None:
            raise errors.UnsupportedModelError(
                f"Sequential model '{model.name}' is not built, so it has no "
                "layer graph yet. Tip: give it an input shape "
                "(`keras.Input(shape)` as the first layer, or "
                "`model.build((None, ...))`), or call it once on data, "
                "then call `checkpoint_model` again."
            )
        return
    if not isinstance(model, keras.src.models.functional.Functional):
        raise errors.UnsupportedModelError(
            f"Model '{model.name}' of class {type(model).__name__} is a "
            "subclassed model: its graph lives in Python code graphckpt "
            "cannot read. Expected a functional `keras.Model(inputs, "
            "outputs)` or a `keras.Sequential`. Tip: inside your `call`, "
            "wrap expensive blocks with `keras.remat(block)`, or rebuild the "
            "model with the functional API."
        )


def _planned(model, segments):
    _check_model(model)
    if is_checkpointed(model):
        raise errors.UnsupportedModelError(
            f"Model '{model.name}' is already checkpointed (it contains "
            "graphckpt Segment layers). Tip: checkpoint the original model, "
            "or use the checkpointed one as it is."
        )
    graph = build_graph(model)
    try:
        return graph, plan_segments(graph, segments=segments)
    except ValueError as e:
        raise errors.InvalidArgumentError(
            f"{e}. Accepted: 'sqrt' (the default), or an int from 1 to the number of layer calls."
        ) from None


def plan(model, *, segments="sqrt"):
    """Plans the segments of `model` without rewriting it.

    Args:
        model: a built functional `keras.Model` or `keras.Sequential`.
        segments: `"sqrt"` (about sqrt(n) segments over n layer calls) or an
            int from 1 to n.

    Returns:
        A `graphckpt.Plan`: plain, immutable data about the segments.

    Raises:
        graphckpt.GraphckptError: for a model or argument graphckpt can't use.

    Example:
        >>> p = graphckpt.plan(model, segments=4)
        >>> [len(s.nodes) for s in p.segments]
    """
    return _planned(model, segments)[1]


def checkpoint_model(model, *, segments="sqrt"):
    """Returns a copy of `model`'s graph that trains with less memory.

    Gradient checkpointing trades compute for memory: the model's layer calls
    are cut into segments, and in training only the tensors that cross
    segment boundaries are kept for the backward pass; each segment's
    interior is recomputed once, during backward.

    Guarantee: the returned model computes the same function with the same
    layer objects and variables (`is`-identical): same outputs, same
    gradients, same BatchNormalization statistics and same Dropout masks as
    the original. Fitting it trains the original's weights. The original
    model is not modified.

    Args:
        model: a built functional `keras.Model` or `keras.Sequential`.
        segments: `"sqrt"` (default: about sqrt(n) segments over n layer
            calls) or an int from 1 to n.

    Returns:
        A new functional `keras.Model`, or `model` itself (with a warning)
        when it has fewer than 2 layer calls.

    Raises:
        graphckpt.NotAModelError: `model` is not a Keras model.
        graphckpt.UnsupportedModelError: subclassed, unbuilt or already
            checkpointed.
        graphckpt.InvalidArgumentError: a bad `segments`.

    Example:
        >>> ck = graphckpt.checkpoint_model(model)
        >>> ck.compile(optimizer="adam", loss="mse")
        >>> ck.fit(x, y)   # trains `model`'s own weights
    """
    graph, the_plan = _planned(model, segments)
    if the_plan.num_layer_calls < 2:
        warnings.warn(
            f"Model '{model.name}' has {the_plan.num_layer_calls} layer "
            "call(s): nothing worth checkpointing. Returning it unchanged.",
            stacklevel=2,
        )
        return model
    return rewrite(model, graph, the_plan)
