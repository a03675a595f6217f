"""Public entry points: `checkpoint_model` and `plan`, and `planned` (a
plan with the graphs it was made on: what `graphckpt inspect` shows).

Arguments are checked here, once, and every failure becomes one
`GraphckptError` that names what was received and what to do.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import NamedTuple

import keras

from graphckpt import errors, keras_compat
from graphckpt.budget import check_batch_size, choose_plan
from graphckpt.graph.attention import chunkable_calls
from graphckpt.graph.build import build_graph, functional_of, kept_whole_note
from graphckpt.graph.nesting import not_opened_note
from graphckpt.graph.shapes import InputShape, open_graph, sized_graph
from graphckpt.planner import Plan
from graphckpt.runtime.checkpointed import checkpointed_model
from graphckpt.runtime.segment import Segment

__all__ = ["checkpoint_model", "plan", "planned", "Planned", "is_checkpointed"]


def _segment_holders(model):
    """Names of `model`'s layers that are, or hold at any depth, a Segment."""
    if not isinstance(model, keras.Model):
        return []
    return [
        layer.name
        for layer in model.layers
        if any(isinstance(inner, Segment) for inner in keras_compat.sublayers(layer))
    ]


def is_checkpointed(model: keras.Model) -> bool:
    """True if `model` already contains graphckpt segments, also inside a
    nested model (a checkpointed model used as a layer)."""
    return bool(_segment_holders(model))


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
                "then try again."
            )
        return
    if not keras_compat.is_functional(model):
        raise errors.UnsupportedModelError(
            f"Model '{model.name}' of class {type(model).__name__} is a "
            "subclassed model: its graph lives in its `call`, which "
            "graphckpt traces only through the fit flag, on the data it "
            "trains on (a functional copy would drop your class). Expected "
            "a functional `keras.Model(inputs, outputs)` or a "
            "`keras.Sequential`. Tip: `graphckpt.install()`, then "
            "`model.fit(..., gradient_checkpointing=True)`."
        )


# The methods through which a model's class changes how it is called,
# compiled and trained. A checkpointed model is a plain functional model:
# overrides of these would not carry over to it.
_BEHAVIOUR = (
    "call",
    "__call__",
    "compile",
    "compute_loss",
    "compute_metrics",
    "train_step",
    "test_step",
    "predict_step",
    "make_train_function",
    "make_test_function",
    "make_predict_function",
    "fit",
    "evaluate",
    "predict",
    "train_on_batch",
    "test_on_batch",
    "predict_on_batch",
)


def overridden_methods(model, names=_BEHAVIOUR):
    """`Class.method` for each of `names` that `model`'s class defines
    outside Keras (and graphckpt), in `names`' order."""
    found = []
    for name in names:
        owner = next((c for c in type(model).__mro__ if name in c.__dict__), None)
        module = getattr(owner, "__module__", "") or ""
        if owner is not None and not module.startswith(("keras.", "graphckpt.")):
            found.append(f"{owner.__qualname__}.{name}")
    return found


def _check_no_overrides(model):
    overrides = overridden_methods(model)
    if overrides:
        raise errors.UnsupportedModelError(
            f"Model '{model.name}' of class {type(model).__name__} overrides {', '.join(overrides)}. "
            "`checkpoint_model` returns a plain functional model, which would silently drop them "
            "(another loss, other metrics, other outputs). Expected a `keras.Model(inputs, "
            "outputs)`, a `keras.Sequential`, or a subclass that only builds one. Tip: train your "
            "own model with `graphckpt.install()` and `model.fit(..., gradient_checkpointing=True)`, "
            "which keeps its class and methods (keras_hub task models included)."
        )


class Planned(NamedTuple):
    """A plan with the graphs it was made on (`graphckpt.api.planned`).

    Attributes:
        graph: the model's layer-call graph (`graphckpt.graph.build.build_graph`),
            which the rewrite takes.
        sized_graph: the same graph with the tensor sizes the plan was
            estimated for (`input_shape` propagated).
        plan: the `graphckpt.Plan`.
        unchanged: why the plan checkpoints nothing (a budget at or above
            the baseline), or None.
    """

    graph: object
    sized_graph: object
    plan: Plan
    unchanged: str | None

    def warn_if_unchanged(self, model_name, stacklevel=2):
        if self.unchanged:
            warnings.warn(
                f"The plan for model '{model_name}' checkpoints nothing: {self.unchanged}.",
                errors.GraphckptWarning,
                stacklevel=stacklevel + 1,
            )


def _check_attention_chunks(chunks):
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise errors.InvalidArgumentError(
            f"`attention_chunks` must be None or a positive int: the number of chunks each "
            f"attention core runs in. Received: attention_chunks={chunks!r}. Tip: try 4 or 8; "
            "`graphckpt.estimate` shows what a plan with it holds."
        )


def planned(
    model: keras.Model,
    *,
    segments: int | str = "auto",
    budget: float | int | str | None = None,
    batch_size: int | None = None,
    policy: str | Callable | None = None,
    input_shape: InputShape | None = None,
    open_layers: bool = False,
    attention_chunks: int | None = None,
) -> Planned:
    """`plan`, with the graphs the plan was made on: for tools that show a
    plan layer by layer (`graphckpt inspect`). Arguments as in `plan`;
    it warns only of unknown dimensions (see `Planned.warn_if_unchanged`)."""
    return _planned(
        model, segments, budget, batch_size, policy, input_shape, stacklevel=3, open_layers=open_layers,
        attention_chunks=attention_chunks,
    )


def _planned(
    model, segments="auto", budget=None, batch_size=None, policy=None, input_shape=None, stacklevel=3, open_layers=False,
    attention_chunks=None,
):
    """`planned`, warning of unknown dimensions at `stacklevel` above its caller."""
    _check_model(model)
    holders = _segment_holders(model)
    if holders:
        # Rewriting it again would put Segments inside Segments: every
        # recompute would recompute the inner ones once more.
        raise errors.UnsupportedModelError(
            f"Model '{model.name}' is already checkpointed: its layer(s) "
            f"{holders} are, or contain, graphckpt Segment layers. Tip: "
            "checkpoint the original model (`graphckpt.uncheckpoint` gives "
            "it back), or use the checkpointed one as it is."
        )
    opened_at = None
    if not isinstance(open_layers, bool) and not callable(open_layers):
        raise errors.InvalidArgumentTypeError(
            f"`open_layers` must be a bool or a callable `open_layers(layer) -> bool`. Received: "
            f"open_layers={open_layers!r}. Tip: pass True, or e.g. `lambda layer: layer.name != 'encoder'`."
        )
    _check_attention_chunks(attention_chunks)
    if open_layers:
        if batch_size is not None:
            check_batch_size(model, batch_size)  # its value, before comparing it with `input_shape`
        # Sized from the model's input shapes, where no `input_shape` is
        # given: the shapes inside an opened layer are what its trace gave,
        # which can lose a dimension the layer itself knows
        # (MultiHeadAttention's projections lose the sequence length).
        graph, input_shape = open_graph(model, input_shape, batch_size, open_layers, whole_attention=bool(attention_chunks))
        if graph.at_known_shapes:  # some layer serves these shapes only
            opened_at = tuple(tuple(s) for s in input_shape)
        if not_opened_note(graph):
            warnings.warn(f"Model '{model.name}':{not_opened_note(graph)}", errors.GraphckptWarning, stacklevel=stacklevel)
    else:
        graph = build_graph(model)
    if batch_size is not None:
        check_batch_size(graph, batch_size)  # before comparing it with `input_shape`
    if attention_chunks and not chunkable_calls(graph):
        warnings.warn(
            f"Model '{model.name}' has no MultiHeadAttention call whose core could run in chunks: "
            f"`attention_chunks={attention_chunks}` changes nothing.",
            errors.GraphckptWarning, stacklevel=stacklevel,
        )
        attention_chunks = None
    sized, batch_size = sized_graph(graph, input_shape, batch_size, stacklevel=stacklevel + 1)
    the_plan, unchanged = choose_plan(
        sized, segments=segments, budget=budget, batch_size=batch_size, policy=policy, attention_chunks=attention_chunks
    )
    if open_layers:
        the_plan = dataclasses.replace(
            the_plan, open_layers=True, opened_at=opened_at, kept_closed=graph.kept_closed
        )
    if attention_chunks:
        the_plan = dataclasses.replace(the_plan, attention_chunks=attention_chunks)
    return Planned(graph, sized, the_plan, unchanged)


def plan(
    model: keras.Model,
    *,
    segments: int | str = "auto",
    budget: float | int | str | None = None,
    batch_size: int | None = None,
    policy: str | Callable | None = None,
    input_shape: InputShape | None = None,
    open_layers: bool = False,
    attention_chunks: int | None = None,
) -> Plan:
    """Plans the segments of `model` without rewriting it.

    Args:
        model: a built functional `keras.Model` or `keras.Sequential`.
        segments: `"auto"` (default: the least estimated peak, and among
            the plans within 1% of it the one that recomputes least;
            the last segment runs inline), `"sqrt"` (round(sqrt(n))
            segments over n layer calls, the last one run inline) or an int
            k from 1 to n (k segments, all recomputed). Cuts go where the
            estimated peak is least. Not with `budget` or `policy`.
        budget: a memory budget for the estimated peak training-step
            activation memory: an int of bytes, a string such as `"512MiB"`,
            `"2GiB"`, `"2GB"` or `"1.5 GB"`, or a float in (0, 1), a
            fraction of the estimated peak without checkpointing. The plan
            of least estimated recompute time that fits is chosen
            (`graphckpt.estimator.cost_model`; on TensorFlow a segment's last calls
            whose backward needs only their inputs, such as a convolution,
            are not run again): calls are recomputed only where memory
            requires it. A budget at or
            above the baseline leaves the model unchanged, with a warning.
        batch_size: the batch size to estimate memory for (default: the
            batch dimension of `input_shape`, else the model's fixed batch
            size, if any). A budget in bytes needs one; without one,
            estimates are per example.
        policy: a recompute policy, `"save_expensive"`,
            `"save_projections"` or a callable from
            `graphckpt.policies`: the calls it names (Dense, convolutions,
            attention, ...) are never recomputed; only the cheap calls
            between them are. Alone, it picks the smallest estimated peak
            under that rule; with `budget`, the least recompute that fits.
        input_shape: the shapes of the inputs you train on, batch dimension
            included, as `model.build` takes them: one shape tuple, a list
            of shapes, or a dict keyed by input name (e.g. `(8, 512)` for
            token ids of shape (None, None)). Its first dimension is the
            batch size, unless None. Shapes are propagated through the
            graph, so estimates and plans are for the real tensor sizes;
            without it, an unknown non-batch dimension counts as 1, with a
            warning. The checkpointed model still takes any shape the
            original does.
        open_layers: also cut inside composite layers: a layer whose `call`
            calls only other layers and `keras.ops` (a transformer block
            written as a `keras.layers.Layer` subclass, Keras's
            `MultiHeadAttention`) is opened into those calls, where its
            traced graph computes what it does (`graphckpt.graph.opening`). A
            callable `open_layers(layer) -> bool` opens only the composite
            layers it says yes to (`lambda layer: not isinstance(layer,
            keras.layers.MultiHeadAttention)`). Experimental; default False.
        attention_chunks: run the core of each `MultiHeadAttention` call
            (keras_hub's attention layers too) in this many pieces of its
            (example, head) pairs (at most batch x heads), each recomputed
            in the backward pass: no score-sized tensor (heads x queries x
            keys) is kept, and the backward pass holds one piece's at a
            time, for one more forward pass of the attention core. Outputs,
            dropout masks and gradients are the same, the latter to
            rounding where a later sum follows the pieces' memory order
            (`graphckpt.runtime.attention`). With `open_layers`, attention
            layers stay whole. Default None: not chunked.

    Returns:
        A `graphckpt.Plan`: plain, immutable data about the segments, with
        `estimated_peak_bytes` and `baseline_peak_bytes` (per example when
        `batch_size` is None; see `graphckpt.estimate`).

    Raises:
        graphckpt.GraphckptError: for a model or argument graphckpt can't use.
        graphckpt.InfeasibleBudgetError: no plan's estimate fits `budget`;
            the message gives the smallest estimate any plan reaches.

    Example:
        >>> p = graphckpt.plan(model, budget=0.3, batch_size=32)
        >>> p.estimated_peak_bytes, p.baseline_peak_bytes
    """
    result = _planned(
        model, segments, budget, batch_size, policy, input_shape, open_layers=open_layers,
        attention_chunks=attention_chunks,
    )
    result.warn_if_unchanged(model.name, stacklevel=2)
    return result.plan


def checkpoint_model(
    model: keras.Model,
    *,
    segments: int | str = "auto",
    budget: float | int | str | None = None,
    batch_size: int | None = None,
    policy: str | Callable | None = None,
    input_shape: InputShape | None = None,
    open_layers: bool = False,
    attention_chunks: int | None = None,
) -> keras.Model:
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
        segments: `"auto"` (default: the least estimated peak, and among
            the plans within 1% of it the one that recomputes least;
            the last segment runs inline), `"sqrt"` (round(sqrt(n))
            segments over n layer calls, the last one run inline) or an int
            k from 1 to n (k segments, all recomputed). Cuts go where the
            estimated peak is least. Not with `budget` or `policy`.
        budget: a memory budget for the estimated peak training-step
            activation memory: an int of bytes, a string such as `"512MiB"`,
            `"2GiB"`, `"2GB"` or `"1.5 GB"`, or a float in (0, 1), a
            fraction of the estimated peak without checkpointing. The plan
            of least estimated recompute time that fits is chosen
            (`graphckpt.estimator.cost_model`; on TensorFlow a segment's last calls
            whose backward needs only their inputs, such as a convolution,
            are not run again): calls are recomputed only where memory
            requires it. A budget at or
            above the baseline leaves the model unchanged, with a warning.
        batch_size: the batch size to estimate memory for (default: the
            batch dimension of `input_shape`, else the model's fixed batch
            size, if any). A budget in bytes needs one; without one,
            estimates are per example.
        policy: a recompute policy, `"save_expensive"`,
            `"save_projections"` or a callable from
            `graphckpt.policies`: the calls it names (Dense, convolutions,
            attention, ...) are never recomputed; only the cheap calls
            between them are. Alone, it picks the smallest estimated peak
            under that rule; with `budget`, the least recompute that fits.
        input_shape: the shapes of the inputs you train on, batch dimension
            included, as `model.build` takes them: one shape tuple, a list
            of shapes, or a dict keyed by input name (e.g. `(8, 512)` for
            token ids of shape (None, None)). Its first dimension is the
            batch size, unless None. Shapes are propagated through the
            graph, so estimates and plans are for the real tensor sizes;
            without it, an unknown non-batch dimension counts as 1, with a
            warning. The checkpointed model still takes any shape the
            original does.
        open_layers, attention_chunks: as for `graphckpt.plan`.

    Returns:
        A new functional `keras.Model`, or `model` itself (with a warning)
        when it has fewer than 2 layer calls or when the plan would
        recompute nothing (a budget at or above the estimated baseline).
        If `model` is compiled, so is the new model, with the same
        arguments: the same optimizer object, loss and metrics.

    Raises:
        graphckpt.NotAModelError: `model` is not a Keras model.
        graphckpt.UnsupportedModelError: subclassed, unbuilt or already
            checkpointed; or a functional subclass that overrides `call`,
            `train_step`, `compile`, ... (keras_hub task models): the fit
            flag trains those.
        graphckpt.InvalidArgumentError: a bad or conflicting `segments`,
            `budget`, `batch_size` or `policy`.
        graphckpt.InfeasibleBudgetError: no plan's estimate fits `budget`.

    Example:
        >>> ck = graphckpt.checkpoint_model(model, budget="2GiB", batch_size=64)
        >>> ck.compile(optimizer="adam", loss="mse")
        >>> ck.fit(x, y)   # trains `model`'s own weights
    """
    _check_model(model)
    _check_no_overrides(model)
    graph, _, the_plan, unchanged = _planned(
        model, segments, budget, batch_size, policy, input_shape, open_layers=open_layers,
        attention_chunks=attention_chunks,
    )
    if unchanged is None and not any(s.remat for s in the_plan.segments) and not the_plan.attention_chunks:
        unchanged = "the plan recomputes no layer call"
    note = kept_whole_note(graph)  # nested models no cut can enter, if any
    if unchanged:
        warnings.warn(
            f"Model '{model.name}' returned unchanged: {unchanged}.{note}", errors.GraphckptWarning, stacklevel=2
        )
        return model
    if the_plan.num_layer_calls < 2:
        warnings.warn(
            f"Model '{model.name}' has {the_plan.num_layer_calls} layer "
            f"call(s): nothing worth checkpointing. Returning it unchanged.{note}",
            errors.GraphckptWarning,
            stacklevel=2,
        )
        return model
    if note:
        warnings.warn(f"Model '{model.name}':{note}", errors.GraphckptWarning, stacklevel=2)
    return _compiled_like(model, checkpointed_model(model, graph, the_plan))


def _compiled_like(model, ck):
    """`ck`, compiled as `model` is, if it is: the same optimizer object
    (fitting `ck` goes on with its state: the variables are the same),
    loss and metrics, as `model.compile` last received them."""
    arguments = keras_compat.compile_arguments(model)
    if arguments is not None:
        ck.compile(**arguments)
    return ck
