"""OLMo 2: Llama with the norms moved after attention and the MLP (on the residual branch, before the
add; no norm before either) and an RMSNorm over the whole query and key projections (not per head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.layers import ForwardContext, RMSNorm
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Olmo2RMSNorm(RMSNorm):
    """Scales in float32 before casting back (Llama's norm casts, then scales): transformers' Olmo2RMSNorm."""

    fusable = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (self.weight * xf).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        q_size, kv_size, _ = self.split
        self.q_norm = Olmo2RMSNorm(q_size, cfg.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(kv_size, cfg.rms_norm_eps)

    def query_key(self, qkv: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        t, (q_size, kv_size, _) = qkv.shape[0], self.split
        q = self.q_norm(qkv[:, :q_size]).view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_norm(qkv[:, q_size : q_size + kv_size]).view(t, self.num_kv_heads, self.head_dim)
        return self.rotate(q, k, ctx)


class Olmo2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Olmo2Attention

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        del self.input_layernorm  # OLMo 2 has none: the checkpoint has no such tensor
        self.post_attention_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: returns (the MLP branch, normed; the stream before it)."""
        stream = x if residual is None else residual + x
        h = self.post_attention_layernorm(self.self_attn(positions, stream, ctx))
        stream = stream + h
        lora = ctx.lora.layer(self.self_attn.layer_idx) if ctx.lora is not None else None
        return self.post_feedforward_layernorm(self.mlp(stream, lora)), stream


class Olmo2ForCausalLM(LlamaForCausalLM):
    layer_cls = Olmo2DecoderLayer

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.model.norm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fused_decode_unsupported(self) -> str | None:
        return "norms after attention and MLP, Q/K norms over the whole projection"
