"""Which layer calls can run their attention core in chunks
(`graphckpt.runtime.attention`), and the node attribute that says they do:
`attention_chunks`, read by the rewrite, which calls such a layer through
its `ChunkedAttention`. The estimator counts them in chunks when asked
(`graphckpt.estimator.peak.node_costs(..., attention_chunks=)`)."""

from graphckpt import keras_compat_attention
from graphckpt.graph.layer_graph import INPUT

__all__ = ["chunkable_attention", "chunkable_calls", "mark_attention_chunks"]


def chunkable_attention(layer):
    """Whether `layer`'s attention core can run in chunks: a
    `keras.layers.MultiHeadAttention` or a subclass (keras_hub's cached
    attention) that keeps Keras's core."""
    return keras_compat_attention.own_core(layer)


def chunkable_calls(graph):
    """The keys of the graph's calls of `chunkable_attention` layers."""
    return [k for k, data in graph.nodes(data=True) if data.get("kind") != INPUT and chunkable_attention(data["layer"])]


def mark_attention_chunks(graph, chunks):
    """Sets the node attribute `attention_chunks` to `chunks` on each call
    of a `chunkable_attention` layer (what the rewrite reads)."""
    for key in chunkable_calls(graph):
        graph.nodes[key]["attention_chunks"] = chunks
