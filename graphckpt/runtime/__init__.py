"""The runtime: what a checkpointed model is and how it runs.

`rewrite` turns (model, plan) into a functional model of `Segment` layers
(`segment`), each run under the backend's rematerialization (`remat`, which
picks `remat_tensorflow`, `remat_jax` or `remat_torch`); `checkpointed` is
the model class that saves as its source model plus its plan, and
`weights` keeps its weights files those of the source model.

Imports: `graphckpt.graph` and the pure `graphckpt.planner`, never the
estimator: a plan is all the runtime needs.
"""
