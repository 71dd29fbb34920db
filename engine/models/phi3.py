"""Phi-3 / Phi-4-mini: Llama whose checkpoint already fuses q/k/v (`self_attn.qkv_proj`) and gate/up
(`mlp.gate_up_proj`, gate rows first) in our layout, so its tensors load as they are; RoPE may turn
only the leading partial_rotary_factor of each head (Phi-4-mini: 0.75). LongRoPE (rope_scaling type
longrope): short factors below original_max_position_embeddings, long ones past it, chosen per token
as transformers chooses them for one sequence, and its attention factor (engine/models/rope.py
LongRopeEmbedding); the model serves max_position_embeddings."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    packed: dict[str, tuple[str, int]] = {}  # the checkpoint's names are our fused parameters' names
