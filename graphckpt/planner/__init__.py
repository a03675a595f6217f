"""The pure planner: plan data, the memory model and the searches.

Import flow inside: `data` -> `memory` -> `search` -> `front` ->
`nested` -> `budget_search`.
Nothing here imports Keras; `graphckpt.plan` is the public face.
"""
