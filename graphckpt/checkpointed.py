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
with checkpointing. Loading needs only `import graphckpt` first (the class is
registered as `graphckpt>CheckpointedModel`); no `custom_objects`.
"""

import dataclasses

import keras

from graphckpt.graph import build_graph
from graphckpt.plan import plan_from_boundaries

__all__ = ["CheckpointedModel", "uncheckpoint", "plan_to_config", "plan_from_config"]


@dataclasses.dataclass(frozen=True, eq=False)
class _Recipe:
    """What a checkpointed model was made from. A plain object, so Keras
    neither tracks it as a sublayer nor walks it when saving weights."""

    source: object
    plan: object


def _call_ordinals(graph):
    """Graph node key -> (layer_name, k): the k-th call of that layer in the
    model. Node indices depend on the layer's history outside the model;
    this count does not, so it survives a save and load."""
    by_layer = {}
    for key, data in graph.nodes(data=True):
        if data["kind"] != "input":
            by_layer.setdefault(key[0], []).append(key)
    return {key: (name, k) for name, keys in by_layer.items() for k, key in enumerate(sorted(keys, key=lambda n: n[1]))}


def plan_to_config(graph, plan):
    """A plan as JSON-friendly data that does not depend on node indices."""
    ordinal = _call_ordinals(graph)
    config = {
        "strategy": plan.strategy,
        "segments": [[list(ordinal[n]) for n in seg.nodes] for seg in plan.segments],
        "remat": [bool(getattr(seg, "remat", True)) for seg in plan.segments],
    }
    # Whatever else the plan records (estimates, budget): plain values.
    extra = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    for name in ("segments", "order", "strategy"):
        extra.pop(name)
    config["info"] = extra
    return config


def plan_from_config(graph, config):
    """The `Plan` that `plan_to_config` described, over `graph`."""
    node_of = {ordinal: key for key, ordinal in _call_ordinals(graph).items()}
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
    plan = plan_from_boundaries(graph, order, boundaries, strategy=config["strategy"], **kwargs)
    fields = {f.name for f in dataclasses.fields(plan)}
    info = {k: v for k, v in config.get("info", {}).items() if k in fields}
    return dataclasses.replace(plan, **info)


@keras.saving.register_keras_serializable(package="graphckpt")
class CheckpointedModel(keras.Model):
    """A functional model made of `Segment` layers, by `checkpoint_model`.

    Use it like any functional model. It saves and loads with
    `model.save(...)` / `keras.saving.load_model(...)` (after
    `import graphckpt`), and `graphckpt.uncheckpoint(model)` returns the
    plain model it was made from.
    """

    def __init__(self, inputs, outputs, *, source, plan, name=None, **kwargs):
        super().__init__(inputs=inputs, outputs=outputs, name=name, **kwargs)
        # The source's dtype policy, not the global one now: `compile` wraps
        # the optimizer for loss scaling by the model's policy. (Functional
        # ignores `dtype=`; the public setter would quantize on a quantized
        # policy, so set it as `Layer.__init__` does.)
        self._dtype_policy = source.dtype_policy
        object.__setattr__(self, "_graphckpt_recipe", _Recipe(source, plan))

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
            "plan": plan_to_config(build_graph(source), self.plan),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        from graphckpt.rewrite import rewrite  # rewrite builds this class

        source = keras.saving.deserialize_keras_object(config["source"], custom_objects=custom_objects)
        graph = build_graph(source)
        model = rewrite(source, graph, plan_from_config(graph, config["plan"]))
        model.trainable = config.get("trainable", True)
        return model

    def _segment_rows(self):
        """`(name, recomputed, [layer names])` per plan segment, in order."""
        from graphckpt.segment import Segment

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
        for name, remat, names in rows:
            count = f"{len(names)} layer" + ("" if len(names) == 1 else "s")
            note = "" if remat else ", not recomputed"
            lines.append(f"  {name} ({count}{note}): {', '.join(names)}")
        print_fn("\n".join(lines))


def uncheckpoint(model):
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
