"""Granite 3: Llama with four multipliers from the config: on the embeddings (embedding_multiplier,
applied by LlamaModel), on each residual branch before its add (residual_multiplier), as the attention
scale in place of 1/sqrt(head_dim) (attention_multiplier), and a divisor of the logits (logits_scaling)."""

from __future__ import annotations

import torch

from engine.models.layers import ForwardContext
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class GraniteAttention(LlamaAttention):
    def attention_scale(self, cfg) -> float:
        return float(cfg.attention_multiplier)


class GraniteDecoderLayer(LlamaDecoderLayer):
    attention_cls = GraniteAttention

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.residual_multiplier = float(cfg.residual_multiplier)

    def forward(self, positions, x, residual, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward, each branch scaled before the next norm adds it."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(positions, h, ctx) * self.residual_multiplier
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        lora = ctx.lora.layer(self.self_attn.layer_idx) if ctx.lora is not None else None
        return self.mlp(h, lora) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    layer_cls = GraniteDecoderLayer

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.logits_scaling = float(cfg.logits_scaling)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling

    def fused_decode_unsupported(self) -> str | None:
        return "residual_multiplier on every residual branch"
