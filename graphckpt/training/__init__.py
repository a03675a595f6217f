"""The fit flag: `model.fit(..., gradient_checkpointing=...)`.

`flag` installs the `fit` wrapper and trains the user's own model through a
checkpointed twin; `data` reads the shapes of the data passed to `fit`;
`report` says what a flagged `fit` planned.

Imports: `graphckpt.api` and everything below it.
"""
