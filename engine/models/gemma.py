"""Gemma 2 and Gemma 3 (text): Llama with

- embeddings scaled by sqrt(hidden), the scale rounded to the model dtype first (as transformers does:
  bf16 turns sqrt(640) = 25.298 into 25.25);
- RMSNorm scaling by (1 + weight), normalised and scaled in float32 before the cast back; the
  checkpoint holds the offset `weight` (llama.cpp's GGUF files hold 1 + weight: the loader subtracts 1,
  engine/weights/gguf/weights.py);
- four norms per layer: before and after attention (input_layernorm, post_attention_layernorm, the
  latter on the attention output before its residual add), before and after the MLP
  (pre_feedforward_layernorm, post_feedforward_layernorm);
- GeGLU: gelu(gate, tanh approximation) * up (`hidden_activation` gelu_pytorch_tanh);
- the attention scale query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5;
- sliding-window and global layers interleaved (`layer_types`; the window itself is the attention
  backends' `window`, set on each layer by LlamaAttention from the config);
- Gemma 2: attention logits soft-capped (cap * tanh(s / cap), `attn_logit_softcapping`, passed to the
  backends as `softcap`) and final logits soft-capped (`final_logit_softcapping`);
- Gemma 3: an RMSNorm (1 + weight) on each query and key head before RoPE, the local (sliding) layers
  with their own RoPE base (rope_local_base_freq, transformers 5: rope_parameters["sliding_attention"])
  and the global ones with rope_theta and its rope_scaling; the final soft-cap optional, no attention
  soft-cap (transformers ignores attn_logit_softcapping for Gemma 3, and so does llama.cpp).

Embeddings are tied in every released Gemma; an untied checkpoint loads as well.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.models.layers import ForwardContext, GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary
from engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    head_dim_of,
)
from engine.models.rope import check_rope_supported, rope_inv_freq

SLIDING = "sliding_attention"  # transformers' layer_types entry of a local layer


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), all in float32, then cast (transformers' Gemma2RMSNorm / Gemma3RMSNorm;
    Llama's norm casts before scaling). The C++ norm kernel scales by weight: not fusable."""

    fusable = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def gelu_tanh_mul(gu: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up of gu = [gate | up] ([T, 2I] -> [T, I])."""
    gate, up = gu.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GemmaMLP(GatedMLP):
    """GeGLU: the fused gate/up product, gelu_tanh(gate) * up, down."""

    activation = "gelu_tanh"  # replace_linears gives its gate/up weight the plain linear role

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        gu = self.gate_up_proj(x)  # [T, 2I]
        if lora is None:
            return self.down_proj(gelu_tanh_mul(gu))
        h = gelu_tanh_mul(lora.add("gate_up", x, gu))
        return lora.add("down", h, self.down_proj(h))


class Gemma2Attention(LlamaAttention):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        cap = getattr(cfg, "attn_logit_softcapping", None)
        self.softcap = float(cap) if cap else None  # the attention backends' tanh cap on q.k * scale

    def attention_scale(self, cfg) -> float:
        return float(cfg.query_pre_attn_scalar) ** -0.5


class Gemma2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Gemma2Attention

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.mlp = GemmaMLP(hidden, cfg.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)  # on the attention output
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)  # on the MLP output

    def forward(self, positions, x, residual, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: returns (the MLP branch, normed; the stream before it)."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, ctx))
        h, residual = self.pre_feedforward_layernorm.add_norm(h, residual)
        lora = ctx.lora.layer(self.self_attn.layer_idx) if ctx.lora is not None else None
        return self.post_feedforward_layernorm(self.mlp(h, lora)), residual


class GemmaModel(LlamaModel):
    def __init__(self, cfg, layer_cls: type[LlamaDecoderLayer], max_positions: int) -> None:
        super().__init__(cfg, layer_cls, max_positions)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embed_scale = math.sqrt(cfg.hidden_size)  # rounded to the model dtype by after_load

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma2DecoderLayer
    model_cls = GemmaModel

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        cap = getattr(cfg, "final_logit_softcapping", None)
        self.final_softcap = float(cap) if cap else None

    def check_config(self, cfg) -> None:
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {act!r} is not supported (Gemma's MLP is GeGLU: gelu_pytorch_tanh)")
        if getattr(cfg, "use_bidirectional_attention", None):
            raise ValueError("use_bidirectional_attention is not supported (a causal decoder only)")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap  # transformers' order of ops

    def fused_decode_unsupported(self) -> str | None:
        """The C++ loop runs Gemma's layer shape (engine/models/fused_decode.py: four (1 + weight) norms,
        GeGLU, the attention-logit soft-cap, local RoPE tables) when every layer has the same cap."""
        caps = {layer.self_attn.softcap for layer in self.model.layers}
        if len(caps) > 1:
            return "attention-logit soft-caps differing between layers"
        attn = self.model.layers[0].self_attn
        if attn.rotary_dim < attn.head_dim:
            return f"partial rotary ({attn.rotary_dim} of {attn.head_dim} dims)"
        if self.attention_sinks:
            return "attention sinks"
        return None

    def after_load(self, dtype: torch.dtype, device: torch.device) -> None:
        super().after_load(dtype, device)
        # transformers multiplies by the scale as a tensor of the embedding's dtype
        self.model.embed_scale = float(torch.tensor(math.sqrt(self.config.hidden_size), dtype=dtype))


class Gemma3Attention(Gemma2Attention):
    qk_norm = True

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.softcap = None  # Gemma 3 has none (transformers and llama.cpp ignore the key)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.local_rope = cfg.layer_types[layer_idx] == SLIDING  # the sliding layers' own RoPE base

    def rotate(self, q: torch.Tensor, k: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = ctx.rope_local if self.local_rope and ctx.rope_local is not None else (ctx.cos, ctx.sin)
        return apply_rotary(q, k, cos, sin)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3Model(GemmaModel):
    def __init__(self, cfg, layer_cls: type[LlamaDecoderLayer], max_positions: int) -> None:
        super().__init__(cfg, layer_cls, max_positions)
        check_rope_supported(cfg, max_positions, SLIDING)
        self.rotary_local = RotaryEmbedding(lambda: rope_inv_freq(cfg, head_dim_of(cfg), SLIDING), max_positions)

    def set_rotary(self, positions: torch.Tensor, ctx: ForwardContext) -> None:
        super().set_rotary(positions, ctx)
        ctx.rope_local = self.rotary_local.lookup(positions)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_cls = Gemma3DecoderLayer
    model_cls = Gemma3Model

    def after_load(self, dtype: torch.dtype, device: torch.device) -> None:
        super().after_load(dtype, device)
        self.model.rotary_local.build(dtype, device)

