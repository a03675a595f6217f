"""The order facts of a layer graph (see `graphckpt.graph.build`), which
the planner's order follows (`graphckpt.planner.data.topological_order`)
and the rewrite runs:

- `state_chains(graph)`, `graph.state_chains`: layer calls that share
  state, which must run in Keras's order;
- `from_inputs(graph)`, `graph.from_inputs`: calls without weights or
  state made from the model's inputs alone, which can run anywhere before
  their readers.
"""

from graphckpt import keras_compat
from graphckpt.graph.layer_graph import INPUT

__all__ = ["from_inputs", "state_chains"]


def _masked(graph):
    """Keys of the graph's tensors that Keras attaches a mask to."""
    return {
        k
        for _, data in graph.nodes(data=True)
        for t, k in zip(data["node"].outputs, data["out_keys"])
        if keras_compat.get_keras_mask(t) is not None
    }


def _runs_user_code(layer):
    """Whether `layer`, or a layer nested in it, runs code graphckpt cannot
    see into: a Lambda, or a layer or op defined outside Keras."""
    import keras

    inner = keras_compat.sublayers(layer) if isinstance(layer, keras.layers.Layer) else [layer]
    return any(isinstance(op, keras.layers.Lambda) or not type(op).__module__.startswith("keras.") for op in inner)


def state_chains(graph):
    """Chains of layer calls that share state, each in Keras's execution
    order.

    A layer called twice (or a nested model holding it) updates the same
    BatchNormalization statistics or seed-generator state on each call, and
    each call reads what the one before it wrote: such calls only give the
    original's results in the original's order. User code (Lambda and custom
    layers) may share state no layer owns, e.g. Keras's global seed generator
    (`keras.random.*` with `seed=None`), so all its calls form one chain too.
    On PyTorch, so do the calls whose dropout draws from torch's global
    generator (a layer with a `SeedGenerator` made without a seed): in another
    order they would draw other masks than the original's.

    The calls that read a tensor with a mask share that mask too: Keras
    attaches it to the tensor, and a layer may change it for the calls
    after (MultiHeadAttention removes its inputs' masks; a nested model's
    call attaches them).
    """
    import keras

    masked = _masked(graph)

    torch_generator = keras.backend.backend() == "torch"
    by_variable = {}
    calls = sorted(graph.nodes(data=True), key=lambda item: item[1]["position"])
    for key, data in calls:
        if data["kind"] == INPUT:
            continue
        layer = data["layer"]
        for v in getattr(layer, "non_trainable_variables", ()):  # ops have none
            by_variable.setdefault(id(v), []).append(key)
        if _runs_user_code(layer):
            by_variable.setdefault("user code", []).append(key)
        if torch_generator and isinstance(layer, keras.layers.Layer) and keras_compat.draws_from_torch_global_generator(layer):
            by_variable.setdefault("torch's global generator", []).append(key)
        for k in dict.fromkeys(data["in_keys"]):
            if k in masked:
                by_variable.setdefault(("mask", k), []).append(key)
    chains = (tuple(keys) for keys in by_variable.values() if len(keys) > 1)
    return list(dict.fromkeys(chains))


def from_inputs(graph, chains):
    """The calls made from the model's inputs alone, through calls without
    weights or state: masks and position ids (keras_hub's decoders make
    their causal masks so). A call qualifies when it has no variables
    (weights, statistics, seed-generator states), runs no user code, is in none of
    `chains` (`state_chains(graph)`), and reads only model inputs and such
    calls' outputs. They can run anywhere before their readers, with the
    same results."""
    found, chained = set(), {key for chain in chains for key in chain}
    for key, data in sorted(graph.nodes(data=True), key=lambda item: item[1]["position"]):
        if data["kind"] == INPUT:
            continue
        layer = data["layer"]
        # `variables`: weights, statistics and seed-generator states (ops have none)
        if getattr(layer, "variables", ()) or _runs_user_code(layer) or key in chained:
            continue
        if all(graph.nodes[p]["kind"] == INPUT or p in found for p in graph.predecessors(key)):
            found.add(key)
    return frozenset(found)
