"""Estimator rules for keras_hub's own layers, registered by
`graphckpt.estimator.keras_rules.find_rule` when the first keras_hub layer is estimated (the
estimator never imports keras_hub itself).

keras_hub's transformer blocks (`TransformerDecoder`, `LlamaTransformerDecoder`,
...) hold sublayers and are estimated by the layer-of-layers rule in
`graphckpt.estimate`, which applies these rules to the sublayers it finds.
"""

import inspect

from graphckpt import keras_compat
from graphckpt.estimator import rules


def _grouped_attention(layer, ins, outs):
    """keras_hub's attention layers of decoder LMs (Llama, Gemma, Mistral,
    Qwen, ...): self-attention over the hidden states with
    `num_query_heads` query heads and `num_key_value_heads` key/value heads
    of `head_dim` (hidden size / query heads where not set), scores as in
    MultiHeadAttention."""
    heads = layer.num_query_heads
    head_dim = getattr(layer, "head_dim", None) or (ins[0].shape[-1] or heads) // heads
    return rules.attention_rule(
        ins, outs, heads, head_dim, kv_heads=getattr(layer, "num_key_value_heads", None), self_attention=True
    )


_SCANNED = set()


def register(module_name):
    """Registers keras_hub's layer rules on the first call, and the
    attention layers of every keras_hub model module loaded and not yet
    scanned (`module_name`, the module of the layer met, among them)."""
    if module_name in _SCANNED:
        return
    if not _SCANNED:
        _register_layers()
    for name, module in keras_compat.hub_model_modules():
        if name not in _SCANNED:
            _SCANNED.add(name)
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ == name and _takes_grouped_heads(cls):
                    rules.register_builtin_rule(cls, _grouped_attention, expensive=True)
    _SCANNED.add(module_name)  # a layers module too: scanned once


def _register_layers():
    fixed = {
        "rms_normalization.RMSNormalization": (rules.layer_norm_rule, False),
        "position_embedding.PositionEmbedding": (rules.free_rule, False),
        "rotary_embedding.RotaryEmbedding": (rules.free_rule, False),
        "token_and_position_embedding.TokenAndPositionEmbedding": (rules.free_rule, False),
    }
    for path, (rule, expensive) in fixed.items():
        module, name = path.rsplit(".", 1)
        cls = keras_compat.hub_class(f"layers.modeling.{module}", name)
        if cls is not None:
            rules.register_builtin_rule(cls, rule, expensive=expensive)


def _takes_grouped_heads(cls):
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False
    return "num_query_heads" in params and "num_key_value_heads" in params

