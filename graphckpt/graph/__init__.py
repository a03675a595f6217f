"""The model side: a Keras model -> a `LayerGraph` of layer calls.

`build` makes the graph (`build_graph`) from a functional model, flattening
the nested models `nesting` says it can enter and the composite layers
`opening` opens; `tracing` first turns a subclassed model's `call` into a
functional graph; `chains` orders calls that share state; `shapes` gives
every tensor its real shape. `layer_graph` is the contract the planner
reads, and the only module here that imports no Keras.

Imports: `graphckpt.errors` and `graphckpt.keras_compat` only.
"""
