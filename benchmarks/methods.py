"""The alternatives graphckpt is compared with, as `graphckpt.measure`
transforms: each is called in the measuring child as `method(build, **kw)`
and returns the model to train. `build()` builds the original model.

- `remat_scope`: Keras's own `keras.RematScope(mode=...)`. The scope must be
  active while layers are *constructed*, so the model is built inside it.
  For `mode="list_of_layers"` the layers named are the compute layers (those
  with a `kernel`, and attention), found by building the model once outside
  the scope and again, with the same names, inside it.
- `whole_remat`: the whole model called through one `keras.remat`, the
  naive way (`training` bound in a closure, keras-team/keras#21207). It keeps
  no state snapshot, so with Dropout or BatchNormalization its gradients and
  statistics are not those of the original model (docs/how-it-works.md); only
  its memory and time are of interest here.
- `equal_segments`: the analogue of PyTorch's `checkpoint_sequential`: cut
  Keras's own execution order of the layer calls into `segments` runs of
  (nearly) equal length, with no preference for cheap boundaries. It uses
  graphckpt's exact `Segment` layer, so it differs from graphckpt's default
  plan only in where the cuts fall, and in the order (Keras's, not
  graphckpt's as-soon-as-possible order). Unlike `checkpoint_sequential`,
  the last segment is checkpointed too.
"""

import math

import keras


def remat_scope(build, mode, output_size_threshold=1024):
    layer_names = None
    if mode == "list_of_layers":
        layer_names = [
            layer.name
            for layer in _all_layers(build())
            if hasattr(layer, "kernel") or isinstance(layer, keras.layers.MultiHeadAttention)
        ]
        keras.backend.clear_session()  # the rebuild gets the same auto names
    with keras.RematScope(mode=mode, output_size_threshold=output_size_threshold, layer_names=layer_names):
        return build()


def _all_layers(model):
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            yield from _all_layers(layer)
        else:
            yield layer


class _WholeRemat(keras.layers.Layer):
    def __init__(self, model, **kwargs):
        super().__init__(**kwargs)
        self.model = model
        self._convert_input_args = False

    def call(self, inputs, training=None):
        flat = keras.tree.flatten(inputs)

        def f(*xs):  # tensors only, positionally: keras-team/keras#21207
            return self.model(keras.tree.pack_sequence_as(inputs, list(xs)), training=training)

        if not training:
            return f(*flat)
        return keras.remat(f)(*flat)

    def compute_output_spec(self, inputs, training=None):
        return self.model.compute_output_spec(inputs)


def whole_remat(build):
    model = build()
    inputs = keras.tree.map_structure(
        lambda t: keras.Input(batch_shape=t.shape, dtype=t.dtype), model.input
    )
    return keras.Model(inputs, _WholeRemat(model)(inputs), name=f"{model.name}_whole_remat")


def equal_segments(build, segments="sqrt"):
    from graphckpt.graph.build import build_graph
    from graphckpt.planner import plan_from_boundaries
    from graphckpt.runtime.checkpointed import checkpointed_model

    model = build()
    graph = build_graph(model)
    layer_calls = [n for n, d in graph.nodes(data=True) if d["kind"] != "input"]
    order = sorted(layer_calls, key=lambda n: graph.nodes[n]["position"])  # Keras's execution order
    n = len(order)
    k = max(1, round(math.sqrt(n))) if segments == "sqrt" else int(segments)
    bounds = sorted({round(i * n / k) for i in range(k)})
    plan = plan_from_boundaries(graph, order, bounds, strategy="equal")
    return checkpointed_model(model, graph, plan)


def graphckpt_budget(build, budget, batch_size):
    """`graphckpt.checkpoint_model(model, budget=..., batch_size=...)` with a
    budget derived from the model (issue 4's comparisons):

    - `"sqrt"`: the sqrt plan's own estimated peak (`segments="sqrt"`), so
      the budget plan should keep the same peak with less recompute;
    - `"auto"`: the same for the default plan (`segments="auto"`);
    - `"min"`: the smallest estimated peak any plan can reach;
    - anything else is passed through (bytes, "512MiB", a fraction).
    """
    import graphckpt

    model = build()
    if budget in ("sqrt", "auto"):
        budget = graphckpt.plan(model, batch_size=batch_size, segments=budget).estimated_peak_bytes
    elif budget == "min":
        from graphckpt.estimator.peak import node_costs
        from graphckpt.graph.build import build_graph
        from graphckpt.planner import smallest_peak

        graph = build_graph(model)
        budget = smallest_peak(graph, node_costs(graph, batch_size))
    return graphckpt.checkpoint_model(model, budget=budget, batch_size=batch_size)
