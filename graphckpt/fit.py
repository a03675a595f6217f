"""The opt-in `model.fit(gradient_checkpointing=...)` flag.

`install()` replaces `keras.Model.fit` with a thin wrapper; `uninstall()`
puts the exact original function back. Nothing else in Keras is changed.
Without the flag the wrapper calls the original `fit` with the same
arguments, so plain `fit` behaves as before. `graphckpt.checkpoint_model` is
the patch-free way to the same result.

With the flag, the wrapper trains **the user's own model**. It builds (once
per model and plan, cached on the model itself) the checkpointed twin that
`checkpoint_model` would return, which holds the same layer objects and
variables. Then, for the duration of that one `fit` call only:

- the model's *training* forward pass (`call(..., training=True)`) is routed
  through the twin, by an instance attribute `call` that shadows the class
  method and is removed in a `finally`; inference (`training=False`:
  validation, `predict`, callbacks) takes the model's own `call`;
- layer losses (activity regularizers, `add_loss`) that the twin's segments
  collected are handed to the model, since the segments are not its
  sublayers and `model.losses` would not see them;
- the model's traced `train_function` is swapped for the checkpointed one,
  kept in the same cache (a plain `fit` afterwards gets its own back, and a
  second flagged `fit` does not retrace; `compile()` invalidates both).

Everything else is the model's own: its optimizer and its state, compiled
loss and metrics, `History`, callbacks, `validation_data`, `class_weight`.
"""

import dataclasses
import functools
import inspect
import math
import numbers
import warnings
import weakref

import keras

from graphckpt import errors, keras_compat
from graphckpt.fit_report import add_hint_to_uncaught_errors, say_plan

__all__ = ["install", "uninstall", "is_installed", "fit"]

_CACHE_ATTR = "_graphckpt_fit_cache"
_MISSING = object()
# The fit that `install` replaced, and the wrapper it installed.
_state = {"original": None, "wrapper": None, "had_own": False}


@dataclasses.dataclass(eq=False)
class _Twin:
    """One checkpointed twin of a model, and its traced train function."""

    model: object
    segments: list
    plan: object = None  # the plan of the latest fit (a cached twin may be from another batch size)
    train_function: object = None
    compiled_with: object = None  # weakref to the model's compile config


class _Cache:
    """Per-model cache: plan key -> `_Twin`. A plain object, so Keras's
    tracking and weight saving ignore it; it dies with the model."""

    def __init__(self):
        self.twins = {}


def _check_flag(gradient_checkpointing, budget):
    """The `segments=` / `budget=` arguments the flag stands for, or None."""
    flag = gradient_checkpointing
    if flag is None or flag is False:
        if budget is not None and flag is False:
            raise errors.InvalidArgumentError(
                f"`budget` needs gradient checkpointing on. Received: gradient_checkpointing=False, budget={budget!r}. "
                "Tip: drop `gradient_checkpointing=False`."
            )
        return None if budget is None else {"budget": budget}
    if flag is True:
        return {} if budget is None else {"budget": budget}
    # Any integer (numpy's too, as `segments=` takes them), but not a bool.
    count = isinstance(flag, numbers.Integral) and not isinstance(flag, bool) and flag >= 1
    if count or (isinstance(flag, str) and flag in ("auto", "sqrt")):
        segments = int(flag) if count else flag
        return {"segments": segments} if budget is None else {"segments": segments, "budget": budget}
    raise errors.InvalidArgumentError(
        "`gradient_checkpointing` must be True, False, None, 'auto', 'sqrt' or a positive int (a "
        f"number of segments). Received: gradient_checkpointing={flag!r}. Tip: use True for the "
        "default plan ('auto': the number of segments with the least estimated peak)."
    )


def _with_data_shapes(planner_kwargs, original, model, args, kwargs):
    """Plans for the data `fit` trains on: the shapes of its first batch
    (`input_shape=`), else, for a byte budget, the batch size `fit` uses."""
    bound = inspect.signature(original).bind_partial(model, *args, **kwargs).arguments
    x, batch_size = bound.get("x"), bound.get("batch_size")
    if not _is_batched(x) and batch_size is None:
        batch_size = 32  # what `fit` uses for arrays
    shapes = _checked(model, _data_shapes(x, batch_size, bound.get("validation_split") or 0.0))
    if shapes is not None:
        return dict(planner_kwargs, input_shape=shapes)
    if "budget" not in planner_kwargs:
        return planner_kwargs
    return dict(planner_kwargs, batch_size=batch_size)


def _shape(dims):
    return tuple(None if d is None else int(d) for d in dims)


def _data_shapes(x, batch_size, validation_split):
    """The input shapes of the first batch `fit` takes from `x`, as
    `input_shape=` spells them, or None when they can't be read without
    consuming data.

    Arrays (and dicts, lists, tuples of arrays): `fit` takes batches of
    `batch_size` from the examples it trains on. A `tf.data` dataset: its
    `element_spec` (the batch dimension may be unknown). Keras `PyDataset`s
    and generators are not read: peeking would run or consume the user's
    data pipeline (its augmentation's random draws included)."""
    from keras import tree
    from keras.utils import unpack_x_y_sample_weight

    if x is None:
        return None
    if not _is_batched(x):
        leaves = tree.flatten(x)
        if not leaves or not all(hasattr(leaf, "shape") and len(leaf.shape) for leaf in leaves):
            return None
        examples = int(leaves[0].shape[0])
        examples = int(math.ceil(examples * (1.0 - validation_split)))
        step = max(1, min(batch_size, examples))
        return _as_input_shape(tree.map_structure(lambda a: (step,) + _shape(a.shape[1:]), x))
    spec = getattr(x, "element_spec", None)
    if spec is None:
        return None
    x_spec = unpack_x_y_sample_weight(spec)[0]
    try:
        shapes = tree.map_structure(lambda s: _shape(s.shape), x_spec)
    except (AttributeError, TypeError, ValueError):  # specs of unknown rank
        return None
    if any(d is None for spec in tree.flatten(x_spec) for d in _shape(spec.shape)[1:]):
        return None  # padded or ragged batches: lengths vary from batch to batch
    return _as_input_shape(shapes)


def _as_input_shape(shapes):
    """A structure of shapes -> `input_shape=`'s spelling (a tuple, a list
    of tuples or a dict of tuples), or None for deeper nesting."""
    if isinstance(shapes, dict):
        flat = all(isinstance(s, tuple) for s in shapes.values())
        return dict(shapes) if flat else None
    if isinstance(shapes, list) or (isinstance(shapes, tuple) and shapes and isinstance(shapes[0], tuple)):
        return list(shapes) if all(isinstance(s, tuple) for s in shapes) else None
    return shapes


def _checked(model, shapes):
    """`shapes` if the planner accepts them for `model`, else None, with a
    warning: `fit` itself will say what is wrong with the data."""
    if shapes is None:
        return None
    from graphckpt.graph import build_graph
    from graphckpt.shapes import parse_input_shape

    try:
        parse_input_shape(build_graph(model), shapes)
    except errors.GraphckptError as e:
        warnings.warn(
            f"Model '{model.name}': gradient checkpointing plans without the shapes of the data "
            f"passed to fit, which don't fit the model's inputs: {e}",
            errors.GraphckptWarning,
            stacklevel=4,
        )
        return None
    except Exception:  # noqa: BLE001 - not a model graphckpt reads: `plan` says why
        return None
    return shapes


def _is_batched(x):
    """True for inputs that bring their own batches (datasets, generators,
    `keras.utils.PyDataset`), for which `fit` ignores `batch_size`."""
    return x is not None and not hasattr(x, "shape") and not isinstance(x, (list, tuple, dict))


def _plan_key(the_plan):
    def inner(seg):
        return tuple((len(sub.nodes), sub.remat) for sub in getattr(seg, "inner", ()))

    return tuple((seg.nodes, getattr(seg, "remat", True), inner(seg)) for seg in the_plan.segments)


def _twin_for(model, planner_kwargs):
    """The cached checkpointed twin of `model` for these planner arguments."""
    from graphckpt import api
    from graphckpt.checkpointed import checkpointed_model
    from graphckpt.graph import build_graph, kept_whole_note
    from graphckpt.segment import Segment

    the_plan = api.plan(model, **planner_kwargs)  # raises the same errors as checkpoint_model
    if the_plan.num_layer_calls < 2 or not any(getattr(s, "remat", True) for s in the_plan.segments):
        return None  # nothing to recompute (`plan` has said why, if a budget)
    cache = model.__dict__.get(_CACHE_ATTR)
    if cache is None:
        cache = _Cache()
        object.__setattr__(model, _CACHE_ATTR, cache)
    key = _plan_key(the_plan)
    twin = cache.twins.get(key)
    if twin is None:
        graph = build_graph(model)
        note = kept_whole_note(graph)
        if note:
            warnings.warn(f"Model '{model.name}':{note}", errors.GraphckptWarning, stacklevel=4)
        ck = checkpointed_model(model, graph, the_plan)
        twin = _Twin(ck, [l for l in ck.layers if isinstance(l, Segment)])
        cache.twins[key] = twin
    twin.plan = the_plan
    return twin


def _compile_token(model):
    config = keras_compat.compile_config(model)
    return None if config is None else weakref.ref(config)


def _same_compile(twin, model):
    token = twin.compiled_with
    return token is not None and token() is not None and token() is keras_compat.compile_config(model)


def _training_call(model, twin):
    """The instance `call` that routes training through `twin`."""
    own_call = model.call  # the bound method the class (or instance) had

    def call(inputs, training=None, mask=None, **kwargs):
        if not training:
            return own_call(inputs, training=training, mask=mask, **kwargs)
        for seg in twin.segments:
            keras_compat.clear_losses(seg)
        outputs = twin.model(inputs, training=training, mask=mask, **kwargs)
        # Segments are not the model's sublayers: move their losses. In a
        # stateless scope too (JAX's trainer): the scope holds them, but
        # `model.losses` there keeps only those its own layers added (by
        # `_loss_ids`), so left with the segments they would be dropped.
        # `Functional.add_loss` is unimplemented; the base one records it.
        for seg in twin.segments:
            losses = keras_compat.own_losses(seg)
            keras_compat.clear_losses(seg)
            if losses:
                keras.layers.Layer.add_loss(model, losses)
        return outputs

    return call


def _check_own_call(model):
    """The flag runs the training forward pass through the model's layer
    graph, so a `call` of its own would be skipped: refuse it."""
    from graphckpt import api

    functional = keras_compat.is_functional(model) or isinstance(model, keras.Sequential)
    overrides = api.overridden_methods(model, ("call",)) if functional else []
    if overrides:  # (a model that is not functional gets `checkpoint_model`'s error)
        raise errors.UnsupportedModelError(
            f"Model '{model.name}' of class {type(model).__name__} overrides {overrides[0]}. "
            "`fit(gradient_checkpointing=...)` recomputes the model's layer graph, so your `call` "
            "would not run in training. Expected a model whose forward pass is its layer graph "
            "(overriding `train_step`, `compute_loss` or `compile` is fine). Tip: wrap the "
            "expensive blocks inside your `call` with `keras.remat(block)`, or fit without the flag."
        )


def _checkpointed_fit(original, model, planner_kwargs, args, kwargs):
    _check_own_call(model)
    twin = _twin_for(model, _with_data_shapes(planner_kwargs, original, model, args, kwargs))
    if twin is None:
        from graphckpt.graph import build_graph, kept_whole_note

        note = kept_whole_note(build_graph(model))
        warnings.warn(
            f"Model '{model.name}': gradient checkpointing has nothing to recompute; plain fit.{note}",
            errors.GraphckptWarning,
            stacklevel=3,
        )
        return original(model, *args, **kwargs)
    say_plan(model, twin.plan, _fit_argument(original, model, args, kwargs, "verbose", "auto"))
    saved_call = model.__dict__.get("call", _MISSING)
    saved_fn = getattr(model, "train_function", None)
    model.train_function = twin.train_function if _same_compile(twin, model) else None
    object.__setattr__(model, "call", _training_call(model, twin))
    try:
        return original(model, *args, **kwargs)
    finally:
        if saved_call is _MISSING:
            model.__dict__.pop("call", None)
        else:
            object.__setattr__(model, "call", saved_call)
        twin.train_function = getattr(model, "train_function", None)
        twin.compiled_with = _compile_token(model)
        model.train_function = saved_fn


def _fit_argument(original, model, args, kwargs, name, default):
    """The value of `fit`'s argument `name` in this call, positional or not."""
    return inspect.signature(original).bind_partial(model, *args, **kwargs).arguments.get(name, default)


_FLAG_DOC = """

    graphckpt (installed by `graphckpt.install()`; `graphckpt.uninstall()`
    removes it) adds two keyword-only arguments:

        gradient_checkpointing: True or "auto" (the number of segments,
            and where they go, with the least estimated peak), "sqrt"
            (round(sqrt(n)) segments over n layer calls), an int (that many
            segments), or False/None (off, the default: plain `fit`). Trains
            this model's own weights with gradient checkpointing, like
            `graphckpt.checkpoint_model`. The plan is for the shapes of the
            data: the first batch of arrays (or dicts and lists of arrays)
            or a `tf.data` dataset's `element_spec`.
        budget: a memory budget for the estimated peak training-step
            memory, as `graphckpt.checkpoint_model` takes it: bytes
            ("2GiB", an int; for a batch of `batch_size`, default 32) or a
            fraction of the baseline (0.3). It implies checkpointing; the
            planner recomputes only where memory requires it.
"""


def _make_wrapper(original):
    @functools.wraps(original)
    def fit(self, *args, gradient_checkpointing=None, budget=None, **kwargs):
        planner_kwargs = _check_flag(gradient_checkpointing, budget)
        if planner_kwargs is None:
            return original(self, *args, **kwargs)
        return _checkpointed_fit(original, self, planner_kwargs, args, kwargs)

    sig = inspect.signature(original)
    extra = [
        inspect.Parameter("gradient_checkpointing", inspect.Parameter.KEYWORD_ONLY, default=None),
        inspect.Parameter("budget", inspect.Parameter.KEYWORD_ONLY, default=None),
    ]
    fit.__signature__ = sig.replace(parameters=list(sig.parameters.values()) + extra)
    fit.__doc__ = (original.__doc__ or "") + _FLAG_DOC
    fit._graphckpt_original = original
    return fit


def fit(model, *args, gradient_checkpointing=True, budget=None, **kwargs):
    """`model.fit(*args, **kwargs)` with gradient checkpointing, without
    `install()`: nothing in Keras is patched.

    The same training as `model.fit(..., gradient_checkpointing=...)` after
    `graphckpt.install()`: the model's own weights, optimizer, metrics,
    callbacks and `History`; the plan is made for the shapes of the data.

    Args:
        model: a compiled functional `keras.Model` or `keras.Sequential`
            (keras_hub task models included).
        *args: `fit`'s positional arguments (`x`, `y`, ...).
        gradient_checkpointing: True or "auto" (default), "sqrt", or an int
            number of segments; False or None: plain `fit`.
        budget: a memory budget, as `graphckpt.checkpoint_model` takes it.
        **kwargs: `fit`'s other keyword arguments.

    Returns:
        The `History` that `model.fit` returns.

    Raises:
        graphckpt.UnsupportedModelError: `model`'s class overrides `fit`,
            which this call would skip: use `install()` and `model.fit`.

    Example:
        >>> model.compile(optimizer="adam", loss="mse")
        >>> history = graphckpt.fit(model, x, y, epochs=3)
    """
    from graphckpt import api

    if not isinstance(model, keras.Model):
        api.checkpoint_model(model)  # raises NotAModelError, with its tip
    overrides = api.overridden_methods(model, ("fit",))
    if overrides:
        raise errors.UnsupportedModelError(
            f"Model '{model.name}' of class {type(model).__name__} overrides {overrides[0]}, which "
            "`graphckpt.fit(model, ...)` would skip: it calls Keras's own `fit`. Tip: call "
            "`graphckpt.install()`, then `model.fit(..., gradient_checkpointing=True)`, which runs your `fit`."
        )
    original = _state["original"] if is_installed() else keras.Model.fit
    planner_kwargs = _check_flag(gradient_checkpointing, budget)
    if planner_kwargs is None:
        return original(model, *args, **kwargs)
    return _checkpointed_fit(original, model, planner_kwargs, args, kwargs)


def is_installed():
    """True while `install()` is in effect."""
    return _state["wrapper"] is not None and keras.Model.fit is _state["wrapper"]


def install() -> None:
    """Adds `gradient_checkpointing=` (and `budget=`) to `keras.Model.fit`.

    It sets one attribute, `keras.Model.fit`, to a wrapper; calling it again
    does nothing. Without the new arguments, `fit` runs unchanged. Undo it
    with `graphckpt.uninstall()`. For the same training without patching
    Keras, use `graphckpt.checkpoint_model(model)` and fit that.

    Example:
        >>> graphckpt.install()
        >>> model.compile(optimizer="adam", loss="mse")
        >>> model.fit(x, y, epochs=3, gradient_checkpointing=True)
    """
    if is_installed():
        return
    original = keras.Model.fit
    _state["had_own"] = "fit" in vars(keras.Model)
    _state["original"] = original
    _state["wrapper"] = _make_wrapper(original)
    keras.Model.fit = _state["wrapper"]


def uninstall() -> None:
    """Restores the exact `keras.Model.fit` that `install()` replaced.

    Does nothing if graphckpt is not installed. Twins already built for
    models stay cached on those models, unused, until the models go away.
    """
    if not is_installed():
        return
    if _state["had_own"]:
        keras.Model.fit = _state["original"]
    else:
        del keras.Model.fit  # back to the inherited trainer's own `fit`
    _state.update(original=None, wrapper=None, had_own=False)


add_hint_to_uncaught_errors()
