"""llama.cpp tensor names -> Hugging Face names, and undoing the Q/K row permutation.

llama.cpp's converter (convert_hf_to_gguf.py, `LlamaModel.permute`) reorders the rows of q_proj and
k_proj in llama-family files so that its rotary kernel can rotate adjacent pairs (GPT-J style), where
Hugging Face's Llama rotates the two halves of each head (NeoX style). Within each head of `dim` rows
it interleaves the first and second half: HF row order [0, 1, ..., dim/2 - 1 | dim/2, ..., dim - 1]
becomes [0, dim/2, 1, dim/2 + 1, ...]. Qwen2/Qwen3 files are written unpermuted (llama.cpp runs them
with NeoX rotary).
"""

from __future__ import annotations

import re

import numpy as np
import torch

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts (engine/models/moe.py): the router, every expert's matrix stacked [E, rows, cols],
    # Qwen2-MoE's shared expert and its gate (a vector [H] in the file, [1, H] in the model)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
ROUTERS = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")  # name ends that llama.cpp keeps in F32
# Per architecture, block names that differ from (and take precedence over) _BLOCK's.
_ARCH_BLOCK = {
    # OLMo 2: norms after attention and MLP (its file has no attn_norm / ffn_norm)
    "olmo2": {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    # Phi-3: q/k/v and gate/up fused in the file as in the checkpoint (ffn_up holds [gate; up])
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # GPT-OSS: the norm before the MLP is post_attention_norm; the attention sinks; the experts' biases
    # (ffn_*_exps.bias) follow from _BLOCK's names (engine/models/gpt_oss.py places the split stacks)
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
    # Gemma 2/3: norms before and after attention and MLP (ffn_norm is the one before the MLP)
    **dict.fromkeys(("gemma2", "gemma3"), {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }),
    # LFM2 (transformers' names): the operator and MLP norms, its attention's out_proj and q/k_layernorm,
    # the MLP's w1/w3/w2, and the short conv (`shortconv.conv` squeezed to [hidden, L_cache] in the file)
    "lfm2": {"attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "attn_output": "self_attn.out_proj",
             "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm",
             "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
             "shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj",
             "shortconv.out_proj": "conv.out_proj"},
}
# Per architecture, global names that differ from _GLOBAL's (LFM2's final norm is token_embd_norm)
_ARCH_GLOBAL = {"lfm2": {"token_embd_norm.weight": "model.embedding_norm.weight"}}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+(?:\.[a-z_]+)?)\.(weight|bias)$")  # (lfm2: shortconv.conv)


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    """The Hugging Face parameter name of a llama.cpp tensor of an `arch` file, or None when it has no
    equivalent."""
    glob = {**_GLOBAL, **_ARCH_GLOBAL.get(arch or "", {})}
    if gguf_name in glob:
        return glob[gguf_name]
    m = _BLOCK_NAME.match(gguf_name)
    block = {**_BLOCK, **_ARCH_BLOCK.get(arch or "", {})}
    if m is None or m.group(2) not in block:
        return None
    layer, kind, param = m.groups()
    return f"model.layers.{layer}.{block[kind]}.{param}"


def gguf_name(hf: str, arch: str | None = None) -> str:
    """The llama.cpp name of a Hugging Face parameter in an `arch` file (the converse of hf_name; test
    files use it)."""
    for g, h in [*_ARCH_GLOBAL.get(arch or "", {}).items(), *_GLOBAL.items()]:
        if h == hf:
            return g
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf)
    if m:
        for g, h in [*_ARCH_BLOCK.get(arch or "", {}).items(), *_BLOCK.items()]:
            if h == m.group(2):
                return f"blk.{m.group(1)}.{g}.{m.group(3)}"
    raise ValueError(f"no llama.cpp name for {hf!r}")


def permuted_heads(gguf: str, num_heads: int, num_kv_heads: int) -> int | None:
    """Heads of a tensor llama.cpp permuted (q or k, weight or bias), else None."""
    m = _BLOCK_NAME.match(gguf)
    if m and m.group(2) == "attn_q":
        return num_heads
    if m and m.group(2) == "attn_k":
        return num_kv_heads
    return None


def unpermute(rows: torch.Tensor | np.ndarray, heads: int):
    """Undo llama.cpp's permutation of the leading (output) axis; any trailing shape, any dtype (float
    values, or raw quantized rows: a block never spans two rows)."""
    n = rows.shape[0]
    if n % (2 * heads):
        raise ValueError(f"{n} rows do not split into {heads} heads of an even size")
    half = n // heads // 2
    split = rows.reshape(heads, half, 2, *rows.shape[1:])  # stored: (head, pair, which half)
    return split.swapaxes(1, 2).reshape(rows.shape)  # -> (head, which half, pair)


def permute(rows: torch.Tensor | np.ndarray, heads: int):
    """llama.cpp's permutation (what its converter writes); unpermute(permute(x)) == x."""
    n = rows.shape[0]
    half = n // heads // 2
    split = rows.reshape(heads, 2, half, *rows.shape[1:])
    return split.swapaxes(1, 2).reshape(rows.shape)
