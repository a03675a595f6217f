"""The estimator: what each layer call keeps and costs, and the estimated
training-step memory of a model with or without a plan.

`rules` is the registry of per-layer rules (public: `LayerRule`,
`register_layer_rule`), filled by `keras_rules` (Keras's layers and ops)
and `hub_rules` (keras_hub's); `layers_inside` prices a layer of layers by
calling it symbolically; `cost_model` prices recompute time; `peak` turns
all of it into the planner's `NodeCosts` and the public `estimate`.

Imports: `graphckpt.graph` and the pure `graphckpt.planner`.
"""
