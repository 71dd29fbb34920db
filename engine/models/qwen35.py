"""Qwen3.5 text model (transformers' Qwen3_5ForCausalLM; its MoE variant Qwen3_5MoeForCausalLM below): a hybrid of Gated DeltaNet linear-attention
layers and gated full-attention layers, `layer_types` naming each ("linear_attention" / "full_attention";
transformers fills it from `full_attention_interval`, default 4: every 4th layer attends).

- every layer pre-norm: h = x + mixer(input_layernorm(x)); h = h + mlp(post_attention_layernorm(h));
  the SwiGLU MLP (gate_proj, up_proj, down_proj); the final norm `model.norm`;
- every RMSNorm scales by (1 + weight) in float32 before the cast (Qwen3_5RMSNorm: Gemma's norm), the
  Q/K norms included; the DeltaNet's output norm is a plain-weight gated norm (gated_deltanet.py);
- the attention layers: q_proj gives per head [query D | gate D]; RMSNorm on each query and key head,
  RoPE on the first partial_rotary_factor of each head (default 0.25; the rest passes), GQA over the
  paged KV cache, then the output times sigmoid(gate) before o_proj (transformers' mrope sections are
  the text positions three times over for a text-only prompt: plain RoPE);
- the DeltaNet layers (engine/models/gated_deltanet.py) keep their conv windows and recurrent matrices
  in a state slot (engine/state/conv_cache.py, delta_cache.py) instead of KV blocks.

Only the attention layers keep KV blocks (num_kv_layers; kv_index: an attention layer's rank among them);
a DeltaNet layer's state_index is its rank among DeltaNet layers. The C++ decode loop and CUDA graphs
decline the model (every step runs these Python layers); speculative decoding, LoRA and GGUF blocks are
refused and prefix caching is turned off at start-up (engine/engine.py), as for LFM2.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.gated_deltanet import GatedDeltaNet
from engine.models.gemma import GemmaRMSNorm
from engine.models.layers import ForwardContext, GatedMLP
from engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel, head_dim_of
from engine.models.moe import MoeCausalLM, SparseMoeBlock, num_experts_of
from engine.models.qwen_moe import check_moe_config
from engine.models.rope import check_rope_supported, rotary_embedding
from engine.state.conv_cache import ConvStateSpec
from engine.state.delta_cache import DeltaStateSpec

LINEAR, ATTENTION = "linear_attention", "full_attention"  # transformers' layer_types entries


def qwen35_layer_types(cfg) -> list[str]:
    """Each layer's kind: `layer_types`, else every full_attention_interval-th layer attends (transformers'
    Qwen3_5TextConfig rule, interval 4 by default)."""
    n = int(cfg.num_hidden_layers)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        interval = int(getattr(cfg, "full_attention_interval", 4) or 4)
        types = [LINEAR if (i + 1) % interval else ATTENTION for i in range(n)]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    bad = sorted({t for t in types if t not in (LINEAR, ATTENTION)})
    if bad:
        raise ValueError(f"layer_types: {bad} are not Qwen3.5 layer kinds ({LINEAR!r}, {ATTENTION!r})")
    return list(types)


class Qwen35Attention(LlamaAttention):
    """GQA with an output gate: q_proj gives [query | gate] per head; (1 + w) RMSNorm on each query and key
    head before (partial) RoPE; o = attention * sigmoid(gate). Reads its own entry of the KV caches
    (kv_index: only attention layers have one)."""

    def __init__(self, cfg, layer_idx: int, kv_index: int) -> None:
        super().__init__(cfg, layer_idx)
        self.kv_index = kv_index
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = [2 * q_size, kv_size, kv_size]  # the fused q_proj (query and gate), k_proj, v_proj
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=bool(getattr(cfg, "attention_bias", False)))
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, d, (qg_size, kv_size, _) = x.shape[0], self.head_dim, self.split
        qkv = self.qkv_proj(x)  # [T, 2 H D + 2 Hkv D]
        qg = qkv[:, :qg_size].view(t, self.num_heads, 2 * d)  # per head: query D, gate D
        gate = qg[..., d:].reshape(t, -1)  # [T, H D]
        q = self.q_norm(qg[..., :d])  # [T, H, D]
        k = self.k_norm(qkv[:, qg_size : qg_size + kv_size].view(t, self.num_kv_heads, d))  # [T, Hkv, D]
        v = qkv[:, qg_size + kv_size :].view(t, self.num_kv_heads, d)  # [T, Hkv, D]
        q, k = self.rotate(q, k, ctx)
        k_cache, v_cache = ctx.kv_caches[self.kv_index]
        o = ctx.backend.forward(q.contiguous(), k.contiguous(), v, k_cache, v_cache, ctx.meta, self.scale,
                                self.window, self.softcap).reshape(t, -1)  # [T, H D]  # fmt: skip
        return self.o_proj(o * torch.sigmoid(gate))


class Qwen35DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, kind: str, kind_index: int) -> None:
        """kind_index: the layer's rank among layers of its kind (its KV entry, or its state row)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.is_attention = kind == ATTENTION
        if self.is_attention:
            self.self_attn = Qwen35Attention(cfg, layer_idx, kind_index)
        else:
            self.linear_attn = GatedDeltaNet(cfg, kind_index)
        self.mlp: GatedMLP | SparseMoeBlock
        if num_experts_of(cfg):  # the MoE variant: experts on every layer, top-k renormalised, a shared expert
            self.mlp = SparseMoeBlock(cfg.hidden_size, int(cfg.moe_intermediate_size), num_experts_of(cfg),
                                      int(cfg.num_experts_per_tok), True, int(cfg.shared_expert_intermediate_size))  # fmt: skip
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: returns (the MLP output, the stream before it)."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(positions, h, ctx) if self.is_attention else self.linear_attn(h, ctx)
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(h), residual


class Qwen35Model(LlamaModel):
    def __init__(self, cfg, layer_cls, max_positions: int) -> None:
        nn.Module.__init__(self)  # LlamaModel's own __init__ builds uniform Llama layers
        check_rope_supported(cfg, max_positions)
        self.rotary = rotary_embedding(cfg, head_dim_of(cfg), max_positions)
        self.embedding_multiplier = 1.0
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        types = qwen35_layer_types(cfg)
        self.layers = nn.ModuleList(Qwen35DecoderLayer(cfg, i, kind, types[:i].count(kind))
                                    for i, kind in enumerate(types))  # fmt: skip
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fused_decode = None  # never set: fused_decode_unsupported declines


class Qwen35ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen35Model
    hybrid = True
    packed = {
        "q_proj": ("qkv_proj", 0),  # query and gate, per head
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "in_proj_qkv": ("in_proj", 0),  # a DeltaNet layer's four input projections: one product
        "in_proj_z": ("in_proj", 1),
        "in_proj_b": ("in_proj", 2),
        "in_proj_a": ("in_proj", 3),
    }

    def check_config(self, cfg) -> None:
        super().check_config(cfg)
        types = qwen35_layer_types(cfg)
        if ATTENTION not in types:
            raise ValueError("layer_types: a Qwen3.5 model without attention layers is not supported")
        if LINEAR in types:
            k_heads, v_heads = int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads)
            if k_heads < 1 or v_heads % k_heads:
                raise ValueError(f"linear_num_value_heads ({v_heads}) must be a multiple of linear_num_key_heads "
                                 f"({k_heads})")  # fmt: skip
            if int(cfg.linear_conv_kernel_dim) < 1:
                raise ValueError(f"linear_conv_kernel_dim must be at least 1, got {cfg.linear_conv_kernel_dim!r}")

    def shard_sizes(self, fused: str, rows: int | None = None) -> list[int]:
        if fused == "qkv_proj":
            return next(layer.self_attn.split for layer in self.model.layers if layer.is_attention)
        if fused == "in_proj":
            return next(layer.linear_attn.split for layer in self.model.layers if not layer.is_attention)
        return super().shard_sizes(fused, rows)

    def fused_decode_unsupported(self) -> str | None:
        return "a hybrid of Gated DeltaNet and gated attention layers (a recurrent state per sequence)"

    def cuda_graphs_unsupported(self) -> str | None:
        return "the DeltaNet layers' state slots are gathered per step (not captured)"

    def _deltanets(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if not layer.is_attention]

    def conv_state_spec(self, dtype: torch.dtype) -> ConvStateSpec | None:
        nets = self._deltanets()
        if not nets:
            return None
        return ConvStateSpec(len(nets), nets[0].channels, nets[0].width, dtype)

    def delta_state_spec(self) -> DeltaStateSpec | None:
        nets = self._deltanets()
        if not nets:
            return None
        return DeltaStateSpec(len(nets), nets[0].v_heads, nets[0].k_dim, nets[0].v_dim)

    @property
    def num_kv_layers(self) -> int:
        return sum(1 for layer in self.model.layers if layer.is_attention)


class Qwen35MoeForCausalLM(MoeCausalLM, Qwen35ForCausalLM):
    """Qwen3.5's MoE variant (transformers' Qwen3_5MoeForCausalLM): the same layers with a sparse MLP on every
    layer (engine/models/moe.py): softmax routing over `num_experts`, the top `num_experts_per_tok`
    renormalised, experts `moe_intermediate_size` wide, plus a shared expert
    (`shared_expert_intermediate_size`) scaled by sigmoid(shared_expert_gate . x), as Qwen2-MoE's."""

    def check_config(self, cfg) -> None:
        check_moe_config(cfg)
        super().check_config(cfg)

    def fused_decode_unsupported(self) -> str | None:
        return Qwen35ForCausalLM.fused_decode_unsupported(self)
