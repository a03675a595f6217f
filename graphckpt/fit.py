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
import numbers
import warnings
import weakref

import keras

from graphckpt import errors

__all__ = ["install", "uninstall", "is_installed"]

_CACHE_ATTR = "_graphckpt_fit_cache"
_MISSING = object()
# The fit that `install` replaced, and the wrapper it installed.
_state = {"original": None, "wrapper": None, "had_own": False}


@dataclasses.dataclass(eq=False)
class _Twin:
    """One checkpointed twin of a model, and its traced train function."""

    model: object
    segments: list
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
    if count or (isinstance(flag, str) and flag == "sqrt"):
        segments = int(flag) if count else flag
        return {"segments": segments} if budget is None else {"segments": segments, "budget": budget}
    raise errors.InvalidArgumentError(
        "`gradient_checkpointing` must be True, False, None, 'sqrt' or a positive int (a number of "
        f"segments). Received: gradient_checkpointing={flag!r}. Tip: use True for sqrt(n) segments."
    )


def _with_batch_size(planner_kwargs, original, model, args, kwargs):
    """A byte budget is for one batch: take the batch size `fit` will use."""
    if "budget" not in planner_kwargs:
        return planner_kwargs
    bound = inspect.signature(original).bind_partial(model, *args, **kwargs).arguments
    batch_size = bound.get("batch_size")
    if batch_size is None and not _is_batched(bound.get("x")):
        batch_size = 32  # what `fit` uses for arrays
    return dict(planner_kwargs, batch_size=batch_size)


def _is_batched(x):
    """True for inputs that bring their own batches (datasets, generators,
    `keras.utils.PyDataset`), for which `fit` ignores `batch_size`."""
    return x is not None and not hasattr(x, "shape") and not isinstance(x, (list, tuple, dict))


def _plan_key(the_plan):
    return tuple((seg.nodes, getattr(seg, "remat", True)) for seg in the_plan.segments)


def _twin_for(model, planner_kwargs):
    """The cached checkpointed twin of `model` for these planner arguments."""
    from graphckpt import api
    from graphckpt.graph import build_graph
    from graphckpt.rewrite import rewrite
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
        ck = rewrite(model, build_graph(model), the_plan)
        twin = _Twin(ck, [l for l in ck.layers if isinstance(l, Segment)])
        cache.twins[key] = twin
    return twin


def _compile_token(model):
    config = getattr(model, "_compile_config", None)
    return None if config is None else weakref.ref(config)


def _same_compile(twin, model):
    token = twin.compiled_with
    return token is not None and token() is not None and token() is getattr(model, "_compile_config", None)


def _training_call(model, twin):
    """The instance `call` that routes training through `twin`."""
    own_call = model.call  # the bound method the class (or instance) had

    def call(inputs, training=None, mask=None, **kwargs):
        if not training:
            return own_call(inputs, training=training, mask=mask, **kwargs)
        for seg in twin.segments:
            seg._clear_losses()
        outputs = twin.model(inputs, training=training, mask=mask, **kwargs)
        # Segments are not the model's sublayers: move their losses. In a
        # stateless scope too (JAX's trainer): the scope holds them, but
        # `model.losses` there keeps only those its own layers added (by
        # `_loss_ids`), so left with the segments they would be dropped.
        # `Functional.add_loss` is unimplemented; the base one records it.
        for seg in twin.segments:
            losses = seg._get_own_losses()
            seg._clear_losses()
            if losses:
                keras.layers.Layer.add_loss(model, losses)
        return outputs

    return call


def _checkpointed_fit(original, model, planner_kwargs, args, kwargs):
    twin = _twin_for(model, _with_batch_size(planner_kwargs, original, model, args, kwargs))
    if twin is None:
        warnings.warn(f"Model '{model.name}': gradient checkpointing has nothing to recompute; plain fit.", stacklevel=3)
        return original(model, *args, **kwargs)
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


_FLAG_DOC = """

    graphckpt (installed by `graphckpt.install()`; `graphckpt.uninstall()`
    removes it) adds two keyword-only arguments:

        gradient_checkpointing: True or "sqrt" (about sqrt(n) segments over
            n layer calls), an int (that many segments), or False/None (off,
            the default: plain `fit`). Trains this model's own weights with
            gradient checkpointing, like `graphckpt.checkpoint_model`.
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


def is_installed():
    """True while `install()` is in effect."""
    return _state["wrapper"] is not None and keras.Model.fit is _state["wrapper"]


def install():
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


def uninstall():
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
