"""The checkpointed model class: saves as its source model plus its plan.

A checkpointed model's layers are `Segment`s whose sub-models replay the
source model's layer calls. Serializing those sub-models one by one would
write a layer shared by two segments twice, and loading would make two
layers out of it: the weight sharing would be lost. So a
`CheckpointedModel` serializes what it was made from instead:

- `source`: the original functional model's own config (the one
  `model.get_config()` gives), which keeps each layer once;
- `plan`: which layer calls each segment holds, as `[layer_name, call]`
  pairs, where `call` counts that layer's calls inside the source model.

`from_config` rebuilds the source, then rewrites it with the same plan, so
the loaded model has the same segments, one object per layer, and trains
with checkpointing. The class is registered as `graphckpt>CheckpointedModel`
when this module is imported: `keras.saving.load_model` needs no
`custom_objects` once graphckpt's Keras side has loaded (the package
docstring says when).

Weights files (`save_weights`, `load_weights`) are the source model's own:
see `graphckpt/runtime/weights.py`. `keras.models.clone_model` clones the source
model and applies the same plan to the clone (see `_clone_for_keras`).
"""

import dataclasses

import keras
from keras import tree

from graphckpt import errors, keras_compat
from graphckpt.graph.build import build_graph, functional_of, saved_ordinals, tensor_key
from graphckpt.graph.shapes import plan_graph
from graphckpt.planner import plan_from_boundaries
from graphckpt.runtime import weights
from graphckpt.runtime.rewrite import rewrite

__all__ = ["CheckpointedModel", "checkpointed_model", "uncheckpoint", "plan_to_config", "plan_from_config"]


@dataclasses.dataclass(frozen=True, eq=False)
class _Recipe:
    """What a checkpointed model was made from. A plain object, so Keras
    neither tracks it as a sublayer nor walks it when saving weights."""

    source: object
    plan: object


def plan_to_config(graph, plan, key_of=None):
    """A plan as JSON-friendly data that does not depend on node indices.

    `key_of` (optional) maps each layer call of the plan to the call that
    stands for it in `graph`, when `graph` is a copy of the plan's graph."""
    ordinal = saved_ordinals(graph)
    key_of = key_of or {}
    config = {
        "strategy": plan.strategy,
        "segments": [[list(ordinal[key_of.get(n, n)]) for n in seg.nodes] for seg in plan.segments],
        "remat": [bool(getattr(seg, "remat", True)) for seg in plan.segments],
    }
    if any(getattr(seg, "inner", ()) for seg in plan.segments):
        # Segments cut again: their inner segments' sizes and flags.
        config["inner"] = [
            [[len(sub.nodes), bool(sub.remat)] for sub in seg.inner] if seg.inner else None
            for seg in plan.segments
        ]
    # Whatever else the plan records (estimates, budget): plain values.
    extra = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    for name in ("segments", "order", "strategy"):
        extra.pop(name)
    config["info"] = extra
    return config


def plan_from_config(graph, config):
    """The `Plan` that `plan_to_config` described, over `graph`."""
    node_of = {ordinal: key for key, ordinal in saved_ordinals(graph).items()}
    order, boundaries = [], []
    for seg in config["segments"]:
        boundaries.append(len(order))
        order.extend(node_of[(name, k)] for name, k in seg)
    if len(order) != len(node_of):
        raise ValueError(
            f"The saved plan names {len(order)} layer calls, but the model has {len(node_of)}."
        )
    kwargs = {}
    if not all(config.get("remat", [True])):
        kwargs["remat"] = config["remat"]
    if config.get("inner"):
        kwargs["inner"] = [None if subs is None else _inner_starts(subs) for subs in config["inner"]]
    plan = plan_from_boundaries(graph, order, boundaries, strategy=config["strategy"], **kwargs)
    fields = {f.name for f in dataclasses.fields(plan)}
    info = {k: v for k, v in config.get("info", {}).items() if k in fields}
    if info.get("opened_at") is not None:  # JSON lists
        info["opened_at"] = tuple(tuple(s) for s in info["opened_at"])
    info["kept_closed"] = tuple(info.get("kept_closed", ()))
    return dataclasses.replace(plan, **info)


def _inner_starts(subs):
    """`[[calls, remat], ...]` -> `(starts, remat)`, as `plan_from_boundaries` takes them."""
    starts, pos = [], 0
    for calls, _ in subs:
        starts.append(pos)
        pos += calls
    return starts, [remat for _, remat in subs]


def _in_source_order(model, own, attribute):
    """`own` (a list of `model`'s variables) in the order the source model
    lists them, then any the source does not have. Keras lists a model's
    variables layer by layer, and a checkpointed model's layers are its
    segments; in the source's order, weight lists (`get_weights`) and the
    optimizer's slots line up with the source model's."""
    recipe = model.__dict__.get("_graphckpt_recipe")
    if recipe is None or recipe.source is None:
        return own
    mine = {id(v) for v in own}
    ordered = [v for v in getattr(recipe.source, attribute) if id(v) in mine]
    placed = {id(v) for v in ordered}
    return ordered + [v for v in own if id(v) not in placed]


_CLONE_ATTR = "_graphckpt_clone"


def _clone_source(model, inputs, operation_fn, call_fn):
    """Clones `model`'s source model as `clone_model` would: each layer
    call replayed, in the plan's order, on `operation_fn(layer)` (Keras's
    clone of the layer, made once per layer, so a shared layer stays one
    layer), through `call_fn` when given.

    Returns:
        `(source, key_of)`: the cloned source model, and a map from each of
        the source's layer calls (graph node keys) to the clone's.
    """
    recipe = model._graphckpt_recipe
    graph = build_graph(recipe.source)
    fn = functional_of(recipe.source)
    values = {tensor_key(t): x for t, x in zip(fn.inputs, tree.flatten(inputs))}
    key_of = {}
    for seg in recipe.plan.segments:
        for key in seg.nodes:
            node = graph.nodes[key]["node"]
            layer = operation_fn(node.operation)
            before = len(keras_compat.inbound_nodes(layer))
            args, kwargs = node.arguments.fill_in({id(t): values[tensor_key(t)] for t in node.input_tensors})
            outputs = layer(*args, **kwargs) if call_fn is None else call_fn(layer, *args, **kwargs)
            calls = len(keras_compat.inbound_nodes(layer)) - before
            if calls != 1:
                raise _cannot_clone(model, f"`call_function` called layer '{layer.name}' {calls} times, not once")
            key_of[key] = (layer.name, before)
            for original, new in zip(node.outputs, tree.flatten(outputs)):
                values[tensor_key(original)] = new
    outputs = tree.pack_sequence_as(keras_compat.structures(fn)[1], [values[tensor_key(t)] for t in fn.outputs])
    return keras.Model(inputs, outputs, name=recipe.source.name), key_of


def _cannot_clone(model, reason):
    return errors.UnsupportedModelError(
        f"`keras.models.clone_model` cannot keep the plan of checkpointed model '{model.name}': "
        f"{reason}. It clones the source model and applies the same segments to the clone, which "
        "needs the clone to make the same layer calls. Tip: clone the plain model and checkpoint "
        "the clone: `graphckpt.checkpoint_model(keras.models.clone_model(graphckpt.uncheckpoint(ck), "
        "...))`."
    )


def _clone_for_keras(model, inputs, operation_fn, call_fn):
    """What `keras.models.clone_model(model, ...)` runs in place of
    `model`'s graph: the source model cloned with the same `clone_function`
    / `call_function`, then rewritten with the same plan.

    Keras then builds `CheckpointedModel(inputs, outputs, name)` from the
    outputs returned here; the rewritten clone waits on them (`_take_clone`)
    and that constructor takes it over.

    Returns:
        The output tensors of the rewritten clone, in the model's structure.

    Raises:
        graphckpt.UnsupportedModelError: `call_function` added or dropped
            layer calls, so the plan does not fit the clone.
    """
    if model.plan.open_layers:
        raise _cannot_clone(model, "its plan cuts inside opened layers, which cloning does not replay yet")
    source, key_of = _clone_source(model, inputs, operation_fn, call_fn)
    graph = build_graph(source)
    config = plan_to_config(graph, model.plan, key_of)
    try:
        plan = plan_from_config(graph, config)
    except ValueError as e:
        raise _cannot_clone(model, f"the clone's layer calls differ from the source's ({e})") from e
    clone = checkpointed_model(source, graph, plan)
    outputs = keras_compat.structures(clone)[1]
    object.__setattr__(tree.flatten(outputs)[0], _CLONE_ATTR, clone)
    return outputs


def _take_clone(outputs):
    """The clone `_clone_for_keras` made with these outputs, if any; it is
    handed out once."""
    first = tree.flatten(outputs)[0] if outputs is not None else None
    clone = getattr(first, _CLONE_ATTR, None)
    if clone is not None:
        object.__delattr__(first, _CLONE_ATTR)
    return clone


def _check_opened_shapes(model, inputs):
    """Layers traced at the planned shapes (`Plan.opened_at`) compute for
    those only (keras_hub's causal mask is a constant of that size)."""
    recipe = model.__dict__.get("_graphckpt_recipe")  # None while Keras builds the model
    at = None if recipe is None else recipe.plan.opened_at
    if at is None:  # every call of every checkpointed model comes here
        return
    got = [None if x is None else tuple(x.shape) for x in tree.flatten(inputs)]
    if len(got) != len(at):
        return
    if any(g is not None and (len(g) != len(w) or any(None not in (a, b) and a != b for a, b in zip(g, w)))
           for g, w in zip(got, at)):
        raise errors.InvalidArgumentError(
            f"Model '{model.name}' opened layers that trace only at known shapes, at input shapes {list(at)} "
            f"(None: any). Received inputs of shapes {got}. Tip: checkpoint the model for these shapes "
            "(`input_shape=`); the fit flag plans for each data shape itself."
        )


@keras.saving.register_keras_serializable(package="graphckpt")
class CheckpointedModel(keras.Model):
    """A functional model made of `Segment` layers, by `checkpoint_model`.

    Use it like any functional model. It saves and loads with
    `model.save(...)` / `keras.saving.load_model(...)` (once this module
    is imported: see the package docstring), and `graphckpt.uncheckpoint(model)` returns the
    plain model it was made from. Its weights files are its source model's:
    `save_weights` writes what the source model would write, and
    `load_weights` reads the source model's files. It lists its variables
    in its source model's order, so `get_weights()` lists and optimizer
    slots line up with the source model's too. `keras.models.clone_model`
    returns a `CheckpointedModel` with the same plan over a clone of the
    source model.
    """

    def __init__(self, inputs, outputs, name=None, *, source=None, plan=None, **kwargs):
        # `clone_model` calls this with (inputs, outputs, name) only: the
        # clone was built by `_run_through_graph` below, and waits on them.
        clone = _take_clone(outputs) if source is None else None
        if source is None:
            if clone is None:
                raise errors.InvalidArgumentError(
                    "A CheckpointedModel is made by `graphckpt.checkpoint_model(model)`, which "
                    f"plans its segments. Received: inputs and outputs only (name={name!r}), no "
                    "source model nor plan. Tip: build the plain model from these tensors with "
                    "`keras.Model(inputs, outputs)` and checkpoint it."
                )
            inputs, source, plan = keras_compat.structures(clone)[0], clone._graphckpt_recipe.source, clone.plan
        # Set first: the variable lists below read it, and Keras may list
        # variables while it builds the model.
        object.__setattr__(self, "_graphckpt_recipe", _Recipe(source, plan))
        super().__init__(inputs=inputs, outputs=outputs, name=name, **kwargs)
        # The source's dtype policy, not the global one now: `compile` wraps
        # the optimizer for loss scaling by the model's policy.
        keras_compat.set_dtype_policy(self, source.dtype_policy)
        if clone is not None:
            keras_compat.set_nodes_by_depth(self, keras_compat.nodes_by_depth(clone))  # the call order rewrite set

    @property
    def variables(self):
        return _in_source_order(self, super().variables, "variables")

    @property
    def weights(self):
        return _in_source_order(self, super().weights, "weights")

    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        """Saves the weights as the source model saves its own.

        The file is the one the source model writes with `save_weights`
        (with this model's optimizer state, if compiled), so it loads into
        the source model, any model of the same architecture, and any
        checkpointed model of one. Arguments as for
        `keras.Model.save_weights`.
        """
        weights.save_weights(self, filepath, overwrite=overwrite, max_shard_size=max_shard_size)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Loads a weights file of the source model, or one this model wrote.

        Reads what `keras.Model.load_weights` reads: `.weights.h5`,
        `.weights.json` (sharded), `.keras` archives and legacy `.h5` files,
        of the source model or a model of the same architecture, and those
        `save_weights` and `save` of this model wrote. A load that fails
        changes nothing.

        Raises:
            graphckpt.InvalidArgumentError: the file does not fit (a
                `ValueError`, as Keras raises).
            graphckpt.WeightsFileError: the file could not be read (an
                `OSError`, as Keras raises, so `BackupAndRestore` falls
                back to its previous backup); `WeightsFileNotFoundError`
                (a `FileNotFoundError`) when it does not exist.
            In every case the model's variables, optimizer and metrics are
            unchanged.
        """
        keras_load = super().load_weights
        weights.load_weights(self, filepath, keras_load, skip_mismatch=skip_mismatch, **kwargs)

    def _run_through_graph(self, inputs, *args, **kwargs):
        operation_fn = kwargs.get("operation_fn", args[0] if args else None)
        if keras_compat.is_clone_operation_fn(operation_fn):
            return _clone_for_keras(self, inputs, operation_fn, kwargs.get("call_fn"))
        _check_opened_shapes(self, inputs)
        return super()._run_through_graph(inputs, *args, **kwargs)

    @property
    def plan(self):
        """The `graphckpt.Plan` this model was built from."""
        return self._graphckpt_recipe.plan

    def get_config(self):
        source = self._graphckpt_recipe.source
        return {
            "name": self.name,
            "trainable": self.trainable,
            "source": keras.saving.serialize_keras_object(source),
            "plan": plan_to_config(plan_graph(source, self.plan), self.plan),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        source = keras.saving.deserialize_keras_object(config["source"], custom_objects=custom_objects)
        info = config["plan"].get("info", {})
        graph = plan_graph(source, info)
        model = checkpointed_model(source, graph, plan_from_config(graph, config["plan"]))
        model.trainable = config.get("trainable", True)
        return model

    def _segment_rows(self):
        """`(name, recomputed, [layer names])` per plan segment, in order."""
        from graphckpt.runtime.segment import Segment

        layers = iter(l for l in self.layers if isinstance(l, Segment))
        rows = []
        for seg in self.plan.segments:
            names = list(dict.fromkeys(node[0] for node in seg.nodes))
            remat = getattr(seg, "remat", True)
            rows.append((next(layers).name if remat else f"inline_{seg.index}", remat, names))
        return rows

    def summary(self, line_length=None, positions=None, print_fn=None, **kwargs):
        """Keras's summary, then each segment with the layers it contains."""
        super().summary(line_length=line_length, positions=positions, print_fn=print_fn, **kwargs)
        print_fn = print_fn or print
        rows = self._segment_rows()
        lines = [
            f"Segments: {len(rows)} over {self.plan.num_layer_calls} layer calls. In training, a "
            "segment keeps only its inputs for backward and recomputes its layers once."
        ]
        cut = {seg.index: seg.inner for seg in self.plan.segments if getattr(seg, "inner", ())}
        for index, (name, remat, names) in enumerate(rows):
            count = f"{len(names)} layer" + ("" if len(names) == 1 else "s")
            note = "" if remat else ", not recomputed"
            lines.append(f"  {name} ({count}{note}): {', '.join(names)}")
            if index in cut:
                parts = [
                    f"{len(sub.nodes)} call" + ("" if len(sub.nodes) == 1 else "s") + ("" if sub.remat else " kept")
                    for sub in cut[index]
                ]
                lines.append(f"    cut again (two levels), each part recomputed once more unless kept: {' | '.join(parts)}")
        print_fn("\n".join(_output_name_notes(self) + lines))


def _output_name_notes(model):
    """A line for each `OutputName` layer of `model`, which its summary
    lists among the real ones."""
    from graphckpt.runtime.rewrite import OutputName

    return [
        f"{layer.name} (OutputName): the output '{layer.name}', made inside a segment, under the name the "
        "original model gives it (loss and metric dicts use it); it computes nothing."
        for layer in model.layers
        if isinstance(layer, OutputName)
    ]


def checkpointed_model(model, graph, plan):
    """The `CheckpointedModel` of `model` (whose layer-call graph is
    `graph`) for `plan`: `graphckpt.runtime.rewrite.rewrite` with this class."""
    return rewrite(model, graph, plan, CheckpointedModel)


def uncheckpoint(model: keras.Model) -> keras.Model:
    """The plain model a checkpointed model was made from, for export or serving.

    It holds the very same layer objects and variables (so the same trained
    weights) and no `Segment`s. For a model from `checkpoint_model(m)` it is
    `m` itself; for a loaded one, the source model rebuilt on load.

    Args:
        model: a model returned by `graphckpt.checkpoint_model`, or loaded
            from one saved with `model.save(...)`.

    Returns:
        A functional `keras.Model` (or the `keras.Sequential` it came from).
        It is not compiled: compile it to train or evaluate it.

    Raises:
        graphckpt.InvalidArgumentError: `model` is not a checkpointed model.

    Example:
        >>> plain = graphckpt.uncheckpoint(ck)
        >>> plain.export("serving_dir")
    """
    from graphckpt import errors

    if not isinstance(model, CheckpointedModel):
        raise errors.InvalidArgumentError(
            "`uncheckpoint` expects a model made by `graphckpt.checkpoint_model`. Received: "
            f"model={getattr(model, 'name', model)!r} of type {type(model).__name__}. "
            "Tip: a model without segments is already plain."
        )
    return model._graphckpt_recipe.source
