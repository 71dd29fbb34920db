"""llama.cpp's lfm2 metadata -> transformers' Lfm2Config fields.

What llama.cpp's converter writes (its LFM2Model): `lfm2.attention.head_count_kv` one entry per layer, 0
for a short-conv layer (that is how a file says which layers attend), `lfm2.shortconv.l_cache` (the
conv taps), `lfm2.attention.layer_norm_rms_epsilon` (norm_eps) and `lfm2.feed_forward_length` already
adjusted by LFM2's block_* rule (so the config says block_auto_adjust_ff_dim false). Tensors: the conv
weight squeezed to [hidden, L_cache] (engine/weights/gguf/weights.py restores [hidden, 1, L_cache]),
`token_embd_norm` the final norm (transformers' embedding_norm), Q/K rows unpermuted.
"""

from __future__ import annotations

from typing import Any

from engine.weights.gguf.errors import GGUFError
from engine.weights.gguf.reader import GGUFFile

CONV, ATTENTION = "conv", "full_attention"


def lfm2_kv_heads(gf: GGUFFile, heads: int) -> tuple[int, list[str]]:
    """(KV heads of the attention layers, layer_types) from attention.head_count_kv (per layer, or one
    number: every layer attends)."""
    key = f"{gf.architecture}.attention.head_count_kv"
    layers = int(gf.get(f"{gf.architecture}.block_count", 0))
    per_layer = gf.arrays.get(key)
    if per_layer is None:
        value = gf.get(key, heads)
        return int(value), [ATTENTION] * layers
    if len(per_layer) != layers:
        raise GGUFError(gf.path, f"metadata {key} has {len(per_layer)} entries for {layers} layers")
    kv = {int(n) for n in per_layer if int(n)}
    if len(kv) != 1:
        raise GGUFError(gf.path, f"metadata {key} is {list(per_layer)}: the attention layers must share one "
                                 "KV head count, and one layer at least must attend")  # fmt: skip
    return kv.pop(), [ATTENTION if int(n) else CONV for n in per_layer]


def lfm2_fields(gf: GGUFFile, fields: dict[str, Any]) -> dict[str, Any]:
    """The LFM2-specific config fields, given the common ones (config.config_fields')."""
    taps = gf.get(f"{gf.architecture}.shortconv.l_cache")
    if isinstance(taps, bool) or not isinstance(taps, int) or taps < 1:
        raise GGUFError(gf.path, f"metadata {gf.architecture}.shortconv.l_cache is {taps!r}, expected the conv taps")
    kv, types = lfm2_kv_heads(gf, fields["num_attention_heads"])
    return {
        "num_key_value_heads": kv,
        "layer_types": types,
        "conv_L_cache": taps,
        "conv_bias": f"blk.{types.index(CONV)}.shortconv.in_proj.bias" in gf.tensor_names() if CONV in types else False,
        "norm_eps": fields["rms_norm_eps"],
        "block_auto_adjust_ff_dim": False,  # feed_forward_length is the adjusted width already
    }
