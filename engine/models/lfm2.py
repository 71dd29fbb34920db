"""LFM2 (Liquid AI; transformers' Lfm2ForCausalLM): a hybrid of gated short-convolution blocks and GQA
attention layers, `layer_types` naming each ("conv" / "full_attention"; transformers derives it from
`full_attn_idxs` in older configs).

- every layer pre-norm: h = x + op(operator_norm(x)); h = h + feed_forward(ffn_norm(h)); the final
  norm is `embedding_norm` (applied after the last layer, whatever its name says);
- op is attention (an RMSNorm on each query and key head, q_layernorm / k_layernorm, before RoPE; the
  output projection `out_proj`) or a short conv (engine/models/short_conv.py) whose window lives in
  the state cache (engine/state/);
- the SwiGLU MLP (w1 gate, w3 up, w2 down) as wide as `lfm2_ff_dim` says;
- RMSNorm as Llama's (normalise in float32, cast, scale) with eps `norm_eps`; tied embeddings by default.

Only the attention layers keep KV blocks (num_kv_layers; each attention layer's kv_index is its rank
among them); the conv layers keep L_cache - 1 columns per sequence in a state slot. The C++ decode loop
and CUDA graphs decline the model (every step runs these Python layers), speculative decoding, LoRA and
prefix caching are refused or turned off at start-up (engine/engine.py).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.layers import ForwardContext, GatedMLP, RMSNorm
from engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel, head_dim_of
from engine.models.rope import check_rope_supported, rotary_embedding
from engine.models.short_conv import ShortConv
from engine.state.conv_cache import ConvStateSpec

CONV, ATTENTION = "conv", "full_attention"  # transformers' layer_types entries


def lfm2_layer_types(cfg) -> list[str]:
    """Each layer's kind, from `layer_types` (or `full_attn_idxs`: the listed layers attend, the rest convolve)."""
    n = int(cfg.num_hidden_layers)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        idxs = getattr(cfg, "full_attn_idxs", None)
        idxs = set(range(n)) if idxs is None else {int(i) for i in idxs}
        types = [ATTENTION if i in idxs else CONV for i in range(n)]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    bad = sorted({t for t in types if t not in (CONV, ATTENTION)})
    if bad:
        raise ValueError(f"layer_types: {bad} are not LFM2 layer kinds ({CONV!r}, {ATTENTION!r})")
    return list(types)


def lfm2_ff_dim(cfg) -> int:
    """The MLP's width, as transformers' Lfm2MLP computes it: with block_auto_adjust_ff_dim, 2/3 of
    intermediate_size, times block_ffn_dim_multiplier (when set), rounded up to block_multiple_of."""
    width = int(cfg.intermediate_size)
    if getattr(cfg, "block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        mult = getattr(cfg, "block_ffn_dim_multiplier", 1.0)
        if mult is not None:
            width = int(mult * width)
            step = int(getattr(cfg, "block_multiple_of", 256))
            width = step * ((width + step - 1) // step)
    return width


class Lfm2Attention(LlamaAttention):
    """GQA with an RMSNorm per query and key head before RoPE, reading its own entry of the KV caches
    (kv_index: only attention layers have one)."""

    def __init__(self, cfg, layer_idx: int, kv_index: int) -> None:
        super().__init__(cfg, layer_idx)
        self.kv_index = kv_index
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)  # the checkpoint's q_layernorm
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, (q_size, kv_size, _) = x.shape[0], self.split
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        v = qkv[:, q_size + kv_size :].view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = self.query_key(qkv, ctx)
        k_cache, v_cache = ctx.kv_caches[self.kv_index]
        o = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.meta, self.scale, self.window,
                                self.softcap).reshape(t, -1)  # [T, H D]
        return self.o_proj(o)

    def query_key(self, qkv: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        t, (q_size, kv_size, _) = qkv.shape[0], self.split
        q = self.q_norm(qkv[:, :q_size].view(t, self.num_heads, self.head_dim))  # [T, H, D]
        k = self.k_norm(qkv[:, q_size : q_size + kv_size].view(t, self.num_kv_heads, self.head_dim))
        return self.rotate(q, k, ctx)


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, kind: str, kind_index: int) -> None:
        """kind_index: the layer's rank among layers of its kind (its KV entry, or its conv-state row)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.is_attention = kind == ATTENTION
        if self.is_attention:
            self.self_attn = Lfm2Attention(cfg, layer_idx, kind_index)
        else:
            self.conv = ShortConv(cfg.hidden_size, int(cfg.conv_L_cache), bool(getattr(cfg, "conv_bias", False)),
                                  kind_index)  # fmt: skip
        self.feed_forward = GatedMLP(cfg.hidden_size, lfm2_ff_dim(cfg))
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, positions, x, residual, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: returns (the MLP output, the stream before it)."""
        h, residual = self.operator_norm.add_norm(x, residual)
        h = self.self_attn(positions, h, ctx) if self.is_attention else self.conv(h, ctx)
        h, residual = self.ffn_norm.add_norm(h, residual)
        return self.feed_forward(h), residual


class Lfm2Model(LlamaModel):
    def __init__(self, cfg, layer_cls, max_positions: int) -> None:
        nn.Module.__init__(self)  # LlamaModel's own __init__ reads rms_norm_eps; LFM2 names it norm_eps
        check_rope_supported(cfg, max_positions)
        self.rotary = rotary_embedding(cfg, head_dim_of(cfg), max_positions)
        self.embedding_multiplier = 1.0
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        types = lfm2_layer_types(cfg)
        self.layers = nn.ModuleList(Lfm2DecoderLayer(cfg, i, kind, types[:i].count(kind))
                                    for i, kind in enumerate(types))  # fmt: skip
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)  # the checkpoint's embedding_norm
        self.fused_decode = None  # never set: fused_decode_unsupported declines


class Lfm2ForCausalLM(LlamaForCausalLM):
    model_cls = Lfm2Model
    hybrid = True
    packed = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "w1": ("gate_up_proj", 0),  # the MLP's gate
        "w3": ("gate_up_proj", 1),  # its up projection
    }
    # checkpoint name part -> ours (after the packed shards above are matched)
    renames = ((".self_attn.out_proj.", ".self_attn.o_proj."), (".self_attn.q_layernorm.", ".self_attn.q_norm."),
               (".self_attn.k_layernorm.", ".self_attn.k_norm."), (".feed_forward.w2.", ".feed_forward.down_proj."),
               ("model.embedding_norm.", "model.norm."))  # fmt: skip

    def check_config(self, cfg) -> None:
        if ATTENTION not in lfm2_layer_types(cfg):
            raise ValueError("layer_types: an LFM2 model without attention layers is not supported")
        if int(getattr(cfg, "conv_L_cache", 0)) < 1:
            raise ValueError(f"conv_L_cache must be at least 1, got {getattr(cfg, 'conv_L_cache', None)!r}")

    def checkpoint_name(self, name: str) -> str:
        for old, new in self.renames:
            name = name.replace(old, new)
        return name

    def shard_sizes(self, fused: str, rows: int | None = None) -> list[int]:
        if fused == "qkv_proj":
            return next(layer.self_attn.split for layer in self.model.layers if layer.is_attention)
        return super().shard_sizes(fused, rows)

    def fused_decode_unsupported(self) -> str | None:
        return "a hybrid of short-convolution and attention layers (a conv state per sequence)"

    def cuda_graphs_unsupported(self) -> str | None:
        return "the short-conv layers' state slots are gathered per step (not captured)"

    def conv_state_spec(self, dtype: torch.dtype) -> ConvStateSpec | None:
        convs = [layer.conv for layer in self.model.layers if not layer.is_attention]
        if not convs:
            return None
        return ConvStateSpec(len(convs), convs[0].hidden, convs[0].width, dtype)

    @property
    def num_kv_layers(self) -> int:
        return sum(1 for layer in self.model.layers if layer.is_attention)
