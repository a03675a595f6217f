"""Which calls of nested models the graph flattens (replays layer by layer,
so cuts can fall inside them) and which stay one node, and why.

A nested functional model or Sequential called as a layer is flattened
when replaying its layer calls one by one computes exactly what calling it
does (`flattenable`); otherwise it stays one call, recomputed whole, and
`graph.kept_whole` records why (`kept_whole_note` words it for the
warnings of `checkpoint_model` and the fit flag).
"""

from graphckpt import keras_compat
from graphckpt.keras_compat import nodes_of

__all__ = ["called_on", "flattenable", "functional_of", "kept_whole_note", "nodes_of"]


def functional_of(model):
    """The `Functional` that holds `model`'s graph (a Sequential's inner one)."""
    import keras

    if isinstance(model, keras.Sequential):
        return keras_compat.sequential_functional(model)
    return model


def flattenable(node, consumed, read=frozenset()):
    """`(Functional, None)` to flatten in place of `node`'s call, or
    `(None, reason)` to keep the call as one node (`reason` None for a call
    that is not a nested model's).

    A call of a nested functional model (or built Sequential) is flattened
    when replaying its layer calls one by one computes exactly what calling
    the model does: its class runs Keras's own `Functional.call` (no
    override), it is called on one structure of tensors that matches its
    inputs in count, dtype and rank (so Keras converts and reshapes nothing),
    with no argument but its inputs (by position or as `inputs=`) and
    `training`, and masks only where Keras fills them in itself (each the
    mask its input carries, which no call before it has read: see
    `_masks_already_attached`); and every call and input
    inside it leads to an output used outside it (so no call, of it or
    before it, becomes dead code that the original would still run).
    """
    import keras
    from keras import tree
    Functional = keras_compat.functional_class()

    op = node.operation
    if not isinstance(op, keras.Model):
        return None, None
    inner = functional_of(op)
    if not isinstance(inner, Functional) or type(op).call not in (Functional.call, keras.Sequential.call):
        return None, f"its class {type(op).__name__} has a `call` of its own"
    if type(inner).call is not Functional.call:
        return None, f"its class {type(inner).__name__} has a `call` of its own"
    kwargs = node.arguments.kwargs
    if set(kwargs) - {"inputs", "training", "mask"} or len(node.arguments.args) + ("inputs" in kwargs) != 1:
        return None, "it is called with arguments besides its inputs and `training`"
    structure = called_on(node)
    outer = tree.flatten(structure)
    if not _masks_already_attached(outer, kwargs.get("mask"), read):
        return None, "it is called with a mask that its input may not carry then"
    mismatch = "it is called on tensors whose number, dtype or rank differ from its inputs'"
    if len(outer) != len(inner.inputs) or not all(
        _is_keras_tensor(t) and t.dtype == x.dtype and len(t.shape) == len(x.shape) for t, x in zip(outer, inner.inputs)
    ):
        return None, mismatch
    try:
        tree.assert_same_structure(structure, keras_compat.structures(inner)[0])
    except (TypeError, ValueError):
        if len(outer) != 1:
            return None, mismatch
    # Every inner call and input must still lead to an output used outside:
    # an output nothing reads (a keras_hub backbone's `sequence_output`
    # beside the `pooled_output` a classifier takes) is fine when calls
    # inside read it, but not an input only passed through to it (whatever
    # made that input outside would become dead code).
    live = {id(x) for x, t in zip(inner.outputs, node.outputs) if id(t) in consumed}
    for n in reversed(nodes_of(inner)):
        if n.is_input:
            continue
        if not any(id(t) in live for t in n.outputs):
            return None, f"its call of '{n.operation.name}' leads only to outputs that nothing outside it reads"
        live.update(id(t) for t in n.input_tensors)
    if not all(id(x) in live for x in inner.inputs):
        return None, "one of its inputs leads to no output that anything outside it reads"
    return inner, None


def _masks_already_attached(outer, mask, read):
    """Whether each mask a nested call passes (`mask`, one per tensor in
    `outer`, or None) is None, or the mask its tensor carries, read by no
    call before (ids of the tensors those read: `read`).

    `Functional.call` attaches the masks it is given to its inputs, and its
    layers read them from there; Keras fills in `mask` itself with the masks
    the inputs carry. Replayed in place of the call, the inner layers get
    the outer tensors themselves, with the masks they carry at run time: the
    same, unless a call before changed them (Keras's MultiHeadAttention
    removes the masks of its inputs), which the nested call would undo.
    """
    from keras import tree

    masks = tree.flatten(mask)
    if all(m is None for m in masks):
        return True
    return len(masks) == len(outer) and all(
        m is None or (m is keras_compat.get_keras_mask(t) and id(t) not in read) for m, t in zip(masks, outer)
    )


def called_on(node):
    """What a nested model's call passed as its `inputs`: the one positional
    argument, or `inputs=` (keras_hub's Gemma3CausalLM calls its backbone
    as `backbone(inputs=inputs)`)."""
    args = node.arguments.args
    return args[0] if args else node.arguments.kwargs["inputs"]


def _is_keras_tensor(x):
    import keras

    return isinstance(x, keras.KerasTensor)


def kept_whole_note(graph):
    """A sentence for a warning: the nested models whose calls stay one node
    (no cut can fall inside them) and why; empty when there are none."""
    whole = graph.kept_whole
    if not whole:
        return ""
    items = "; ".join(f"'{name}' ({why})" for name, why in whole.items())
    return (
        f" Nested models called as one layer, which no cut can enter: {items}. "
        "docs/how-it-works.md says when graphckpt cuts inside a nested model."
    )


def not_opened_note(graph):
    """A sentence for a warning: the composite layers `open_layers` left
    whole (one call, no cut inside) and why, grouped by reason; empty when
    there are none."""
    by_reason = {}
    for path, why in graph.not_opened.items():
        by_reason.setdefault(why, []).append(f"'{path}'")
    if not by_reason:
        return ""
    items = "; ".join(f"{', '.join(paths)}: {why}" for why, paths in by_reason.items())
    return f" Composite layers kept whole by `open_layers`, which no cut can enter: {items}."
