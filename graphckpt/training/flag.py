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

from graphckpt import errors, keras_compat
from graphckpt.graph import opening, tracing
from graphckpt.training import data as fit_data
from graphckpt.training.report import add_hint_to_uncaught_errors, say_plan

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
    """Per-model cache. `plans`: planner arguments (`_arguments_key`) ->
    `(twin, plan)` they planned, or a string saying why there is nothing to
    recompute; `twins`: plan (`_plan_key`) -> `_Twin`, shared by arguments
    that plan alike. A plain object, so Keras's tracking and weight saving
    ignore it; it dies with the model."""

    def __init__(self):
        self.plans = {}
        self.twins = {}


def _check_flag(gradient_checkpointing, budget, open_layers=False, attention_chunks=None):
    """The planner arguments (`segments=`, `budget=`, `open_layers=`,
    `attention_chunks=`) the flag stands for, or None."""
    planner_kwargs = _check_segments(gradient_checkpointing, budget)
    extra = {k: v for k, v in (("open_layers", open_layers), ("attention_chunks", attention_chunks)) if v}
    if extra and planner_kwargs is None:
        name, value = next(iter(extra.items()))
        raise errors.InvalidArgumentError(
            f"`{name}` needs gradient checkpointing on. Received: gradient_checkpointing="
            f"{gradient_checkpointing!r}, {name}={value!r}. Tip: add `gradient_checkpointing=True`."
        )
    return planner_kwargs if planner_kwargs is None else dict(planner_kwargs, **extra)


def _check_segments(gradient_checkpointing, budget):
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
        "default plan ('auto': the least estimated peak, recomputing least)."
    )


def _plan_key(the_plan):
    def inner(seg):
        return tuple((len(sub.nodes), sub.remat) for sub in getattr(seg, "inner", ()))

    return tuple((seg.nodes, getattr(seg, "remat", True), inner(seg)) for seg in the_plan.segments)


def _arguments_key(model, planner_kwargs):
    """What a plan of `model` depends on besides its graph: the planner
    arguments (the data's shapes among them), the dtype policy, and which
    variables train (the estimate counts their gradients)."""
    arguments = repr(sorted(planner_kwargs.items()))
    return arguments, model.dtype_policy.name, tuple(v.trainable for v in model.variables)


def _twin_for(model, planner_kwargs, without_shapes=None, traced=None):
    """The cached checkpointed twin of `model` for these planner arguments,
    or None when there is nothing to recompute. Planned once per model and
    arguments (`_arguments_key`); `without_shapes`: the arguments to plan
    with instead if the data's shapes don't fit the model (see
    `with_data_shapes`); `traced`: the `tracing.Traced` graph of a
    subclassed model's `call`, planned in place of the model."""
    cache = model.__dict__.get(_CACHE_ATTR)
    if cache is None:
        cache = _Cache()
        object.__setattr__(model, _CACHE_ATTR, cache)
    key = (_arguments_key(model, planner_kwargs), None if traced is None else id(traced.functional))
    if key not in cache.plans:
        graph_model = model if traced is None else traced.functional
        cache.plans[key] = _plan_twin(graph_model, cache, planner_kwargs, without_shapes, name=model.name)
    found = cache.plans[key]
    if isinstance(found, str):
        warnings.warn(
            f"Model '{model.name}': gradient checkpointing has nothing to recompute; plain fit.{found}",
            errors.GraphckptWarning,
            stacklevel=4,
        )
        return None
    twin, twin.plan = found  # the plan of these arguments (estimates for this batch)
    return twin


def _plan_twin(model, cache, planner_kwargs, without_shapes, name):
    """Plans `model` (one graph build) and makes its twin: `(twin, plan)`,
    or why there is nothing to recompute (a string, with any nested model
    kept whole). `name`: the name of the model `fit` trains, for warnings."""
    from graphckpt import api
    from graphckpt.graph.build import kept_whole_note
    from graphckpt.runtime.checkpointed import checkpointed_model
    from graphckpt.runtime.segment import Segment

    if "input_shape" in planner_kwargs and fit_data.checked_shapes(model, planner_kwargs["input_shape"]) is None:
        planner_kwargs = without_shapes if without_shapes is not None else planner_kwargs
    result = api.planned(model, **planner_kwargs)  # raises the same errors as checkpoint_model
    result.warn_if_unchanged(name, stacklevel=5)
    the_plan, note = result.plan, kept_whole_note(result.graph)
    if the_plan.num_layer_calls < 2 or not any(getattr(s, "remat", True) for s in the_plan.segments):
        return note
    key = _plan_key(the_plan)
    if key not in cache.twins:
        if note:
            warnings.warn(f"Model '{name}':{note}", errors.GraphckptWarning, stacklevel=5)
        ck = checkpointed_model(model, result.graph, the_plan)
        cache.twins[key] = _Twin(ck, [l for l in ck.layers if isinstance(l, Segment)])
    return cache.twins[key], the_plan


def _compile_token(model):
    config = keras_compat.compile_config(model)
    return None if config is None else weakref.ref(config)


def _same_compile(twin, model):
    token = twin.compiled_with
    return token is not None and token() is not None and token() is keras_compat.compile_config(model)


def _training_call(model, twin, traced=None):
    """The instance `call` that routes training through `twin`. `traced`:
    the `tracing.Traced` graph `twin` was made of (a subclassed model),
    which takes the inputs alone and returns the losses `call` added too."""
    own_call = model.call  # the bound method the class (or instance) had
    takes_training = "training" in inspect.signature(own_call).parameters

    def call(*args, **kwargs):
        if takes_training and not kwargs.get("training"):
            return own_call(*args, **kwargs)
        if traced is not None and (len(args) != 1 or any(v is not None for k, v in kwargs.items() if k != "training")):
            tracing.warn_untraced_call(model, kwargs)
            return own_call(*args, **kwargs)
        for seg in twin.segments:
            keras_compat.clear_losses(seg)
        outputs = twin.model(*args, **kwargs)
        losses = []
        if traced is not None:
            outputs, losses = traced.split(outputs)
        # Segments are not the model's sublayers: move their losses. In a
        # stateless scope too (JAX's trainer): the scope holds them, but
        # `model.losses` there keeps only those its own layers added (by
        # `_loss_ids`), so left with the segments they would be dropped.
        # `Functional.add_loss` is unimplemented; the base one records it.
        for seg in twin.segments:
            losses += keras_compat.own_losses(seg)
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
    if overrides:  # (a subclassed model's `call` is traced instead: `tracing`)
        raise errors.UnsupportedModelError(
            f"Model '{model.name}' of class {type(model).__name__} overrides {overrides[0]}. "
            "`fit(gradient_checkpointing=...)` recomputes the model's layer graph, so your `call` "
            "would not run in training. Expected a model whose forward pass is its layer graph "
            "(overriding `train_step`, `compute_loss` or `compile` is fine). Tip: wrap the "
            "expensive blocks inside your `call` with `keras.remat(block)`, or fit without the flag."
        )


def _checkpointed_fit(original, model, planner_kwargs, args, kwargs):
    # Planning and rewriting run layers symbolically, which on PyTorch can
    # fall back to real tensors (float16 on the CPU) and draw from its global
    # generator: kept, so that training draws what plain `fit` draws.
    with opening.random_state_kept():
        twin, traced = _prepare(original, model, planner_kwargs, args, kwargs)
    if twin is None:
        return original(model, *args, **kwargs)
    say_plan(model, twin.plan, _fit_argument(original, model, args, kwargs, "verbose", "auto"))
    saved_call = model.__dict__.get("call", _MISSING)
    saved_fn = getattr(model, "train_function", None)
    model.train_function = twin.train_function if _same_compile(twin, model) else None
    object.__setattr__(model, "call", _training_call(model, twin, traced))
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


def _prepare(original, model, planner_kwargs, args, kwargs):
    """`(twin, traced)` for this flagged fit (`twin` None: plain fit);
    `traced`: a subclassed model's traced `call`, else None."""
    traced = None
    if tracing.is_subclassed(model):
        traced = _traced(original, model, planner_kwargs, args, kwargs)
        if traced is None:
            return None, None
        if not planner_kwargs.get("open_layers"):
            planner_kwargs = dict(planner_kwargs, open_layers=tracing.nested_models)
    else:
        fit_data.build_like_fit(model, original, args, kwargs)
        _check_own_call(model)
    shapes = fit_data.with_data_shapes(planner_kwargs, original, model, args, kwargs)
    return _twin_for(model, *shapes, traced=traced), traced


def _traced(original, model, planner_kwargs, args, kwargs):
    """The traced graph of a subclassed `model`'s `call` for the data's
    first batch (`tracing.trace_model`; the model is built on that batch
    first, as `fit` builds it). A `call` that can't be traced raises, or,
    for `gradient_checkpointing="auto"`, warns and returns None: plain fit."""
    why = "is subclassed, and the flag traces its `call` into a layer graph"
    batch = fit_data.first_batch(model, original, args, kwargs, why)
    try:  # built as the trainer builds it; a `call` that can't run so is refused by the trace
        if not model.built:
            keras_compat.compute_output_spec(model, batch, training=False)
    except Exception:  # noqa: BLE001, S110
        pass
    try:
        return tracing.trace_model(model, batch)
    except errors.UnsupportedModelError as e:
        if planner_kwargs.get("segments") != "auto":
            raise
        warnings.warn(f"{e} Plain fit.", errors.GraphckptWarning, stacklevel=5)
        return None


def _fit_argument(original, model, args, kwargs, name, default):
    """The value of `fit`'s argument `name` in this call, positional or not."""
    return inspect.signature(original).bind_partial(model, *args, **kwargs).arguments.get(name, default)


_FLAG_DOC = """

    graphckpt (installed by `graphckpt.install()`; `graphckpt.uninstall()`
    removes it) adds three keyword-only arguments:

        gradient_checkpointing: True or "auto" (the least estimated peak,
            at the least recompute among plans within 1% of it), "sqrt"
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
        open_layers: True, or a predicate `open_layers(layer) -> bool`:
            also cut inside composite layers (a layer whose
            `call` calls other layers: keras_hub's `ViTEncoder`, Keras's
            `MultiHeadAttention`), as `graphckpt.checkpoint_model` does.
            Experimental; default False.
        attention_chunks: run each attention core in this many query
            chunks, as `graphckpt.checkpoint_model` does. Default None.
"""


def _make_wrapper(original):
    @functools.wraps(original)
    def fit(self, *args, gradient_checkpointing=None, budget=None, open_layers=False, attention_chunks=None, **kwargs):
        planner_kwargs = _check_flag(gradient_checkpointing, budget, open_layers, attention_chunks)
        if planner_kwargs is None:
            return original(self, *args, **kwargs)
        return _checkpointed_fit(original, self, planner_kwargs, args, kwargs)

    sig = inspect.signature(original)
    extra = [
        inspect.Parameter("gradient_checkpointing", inspect.Parameter.KEYWORD_ONLY, default=None),
        inspect.Parameter("budget", inspect.Parameter.KEYWORD_ONLY, default=None),
        inspect.Parameter("open_layers", inspect.Parameter.KEYWORD_ONLY, default=False),
        inspect.Parameter("attention_chunks", inspect.Parameter.KEYWORD_ONLY, default=None),
    ]
    fit.__signature__ = sig.replace(parameters=list(sig.parameters.values()) + extra)
    fit.__doc__ = (original.__doc__ or "") + _FLAG_DOC
    fit._graphckpt_original = original
    return fit


def fit(model, *args, gradient_checkpointing=True, budget=None, open_layers=False, attention_chunks=None, **kwargs):
    """`model.fit(*args, **kwargs)` with gradient checkpointing, without
    `install()`: nothing in Keras is patched.

    The same training as `model.fit(..., gradient_checkpointing=...)` after
    `graphckpt.install()`: the model's own weights, optimizer, metrics,
    callbacks and `History`; the plan is made for the shapes of the data.

    Args:
        model: a compiled `keras.Model`: functional, a `keras.Sequential`
            (keras_hub task models included), or a subclass whose `call`
            is traced on the data (see `graphckpt.graph.tracing`).
        *args: `fit`'s positional arguments (`x`, `y`, ...).
        gradient_checkpointing: True or "auto" (default), "sqrt", or an int
            number of segments; False or None: plain `fit`.
        budget: a memory budget, as `graphckpt.checkpoint_model` takes it.
        open_layers, attention_chunks: as `graphckpt.checkpoint_model`
            takes them.
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
    planner_kwargs = _check_flag(gradient_checkpointing, budget, open_layers, attention_chunks)
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
