"""Recompute policies: which layer calls are never recomputed.

A policy is a small named callable `policy(layer) -> bool`: true means the
call's activations are kept, as in the original model, and the call is not
recomputed. The planner then checkpoints only the calls between them: with
no budget, it takes the plan of smallest estimated peak that recomputes none
of the saved calls; with a budget, the plan of least recompute that fits.

The cut stays exact: saved calls run inline, unchanged, and every other run
of calls is an exact `graphckpt.Segment`. Granularity is the Keras layer: a
`MultiHeadAttention` layer is saved (or recomputed) as a whole.

This is the Keras analogue of JAX's `jax.checkpoint_policies`
(`checkpoint_dots`, `save_only_these_names`).

Example:
    >>> graphckpt.checkpoint_model(model, policy="save_expensive")
    >>> graphckpt.checkpoint_model(model, policy=graphckpt.policies.save_these_layers("conv1", "conv2"))
"""

import dataclasses

__all__ = ["save_expensive", "save_projections", "save_these_layers", "resolve", "NAMED"]


def save_expensive(layer):
    """Keeps matmul-like calls (Dense, EinsumDense, convolutions, attention,
    recurrent layers, nested models holding any); recomputes the cheap ones
    between them (activations, normalization, dropout, pooling, elementwise)."""
    from graphckpt.estimator.keras_rules import is_expensive

    return is_expensive(layer)


def save_projections(layer):
    """Keeps the calls of matmul-like layers, as `save_expensive` does, but
    recomputes Keras ops, matmuls included. With `open_layers=True`, an
    attention layer's projections (query, key, value, output) and the
    feed-forward's Denses are kept, and the attention core between them
    (the scores' einsum, softmax, dropout, the weighted sum), whose tensors
    grow with the square of the sequence, is recomputed: Megatron-LM's
    selective activation recomputation (Korthikanti et al., 2022). Without
    `open_layers`, an attention layer is one call, kept whole."""
    import keras

    from graphckpt.estimator.keras_rules import is_expensive

    return isinstance(layer, keras.layers.Layer) and is_expensive(layer)


@dataclasses.dataclass(frozen=True)
class save_these_layers:  # noqa: N801 - named like a function, as JAX's policies
    """Keeps the calls of the layers named (or of the classes named) here.

    Example:
        >>> policy = save_these_layers("stem_conv", "Conv2D")
    """

    names: tuple

    def __init__(self, *names):
        object.__setattr__(self, "names", tuple(names))

    def __call__(self, layer):
        return layer.name in self.names or type(layer).__name__ in self.names


NAMED = {"save_expensive": save_expensive, "save_projections": save_projections}


def resolve(policy):
    """A policy argument -> (name, callable), or (None, None) for no policy.

    Raises:
        ValueError: `policy` is neither a known name nor a callable, or is
            a class (such as `save_these_layers` without its arguments).
    """
    if policy is None:
        return None, None
    if isinstance(policy, str):
        if policy not in NAMED:
            raise ValueError(
                f"Unknown `policy`. Received: policy={policy!r}. Accepted: "
                f"{sorted(NAMED)}, a callable `policy(layer) -> bool`, or None"
            )
        return policy, NAMED[policy]
    if isinstance(policy, type):
        # A class is callable too: `save_these_layers(layer)` would build a
        # policy naming that layer, which is true, so every call is saved.
        raise ValueError(
            f"`policy` must be a policy, not a class. Received: policy={policy!r}. Tip: "
            f"create one with its arguments, e.g. policy={policy.__name__}('conv1', 'Conv2D')."
        )
    if callable(policy):
        name = getattr(policy, "__name__", None) or repr(policy)
        return name, policy
    raise ValueError(
        f"`policy` must be a name, a callable `policy(layer) -> bool`, or None. "
        f"Received: policy={policy!r}. Accepted names: {sorted(NAMED)}"
    )
