"""Granite 4 (IBM; transformers' GraniteMoeHybridForCausalLM, model_type granitemoehybrid): Mamba2 layers
mixed with GQA attention layers (`layer_types`: "mamba" / "attention" in the hub's configs, which
transformers reads as "linear_attention" / "full_attention").

- every layer pre-norm, each branch scaled by `residual_multiplier` before its add (Granite 3's rule);
  the embeddings times `embedding_multiplier`, the logits divided by `logits_scaling`;
- the mixer is attention (scale `attention_multiplier`; RoPE only with position_embedding_type "rope",
  none otherwise: the Granite 4.0-H models are NoPE) or Mamba2 (engine/models/mamba2.py), whose conv
  window and SSM matrices live in the state cache (engine/state/);
- the MLP is a SwiGLU `shared_mlp` (shared_intermediate_size; `input_linear` holds gate then up), plus,
  with num_local_experts > 0, a mixture of experts (`block_sparse_moe`: top-k over the router's logits,
  a softmax over the k; each expert a SwiGLU of intermediate_size) added to it.

Only the attention layers keep KV blocks (num_kv_layers; each attention layer's kv_index is its rank among
them). The C++ decode loop and CUDA graphs decline the model; speculative decoding, LoRA and prefix
caching are refused or turned off at start-up (engine/engine.py), as for LFM2.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.models.gpt_oss import route_topk_softmax
from engine.models.granite import GraniteAttention
from engine.models.layers import ForwardContext, GatedMLP, RMSNorm
from engine.models.llama import LlamaForCausalLM, LlamaModel, head_dim_of
from engine.models.mamba2 import Mamba2Mixer
from engine.models.moe import MoeCausalLM, SparseMoeBlock, grouped_experts
from engine.models.rope import check_rope_supported, rotary_embedding
from engine.state.conv_cache import ConvStateSpec
from engine.state.ssm_cache import SsmStateSpec

MAMBA, ATTENTION = "mamba", "attention"
_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}


def granite4_layer_types(cfg) -> list[str]:
    """Each layer's kind, MAMBA or ATTENTION, from `layer_types` (or `layers_block_type`; none: every
    layer Mamba2, transformers' default)."""
    n = int(cfg.num_hidden_layers)
    types = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None) or ["mamba"] * n
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    bad = sorted({t for t in types if t not in _KINDS})
    if bad:
        raise ValueError(f"layer_types: {bad} are not Granite 4 layer kinds ({sorted(_KINDS)})")
    return [_KINDS[t] for t in types]


def uses_rope(cfg) -> bool:
    """position_embedding_type "rope": RoPE on every attention layer; None or "nope": none (transformers
    builds its rotary embedding only for "rope")."""
    kind = getattr(cfg, "position_embedding_type", None)
    if kind not in (None, "rope", "nope"):
        raise ValueError(f"position_embedding_type {kind!r} is not supported (None, 'nope' or 'rope')")
    return kind == "rope"


class Granite4Attention(GraniteAttention):
    """Granite's attention (scale attention_multiplier), NoPE unless the config asks for RoPE, reading
    its own entry of the KV caches (kv_index: only attention layers have one)."""

    def __init__(self, cfg, layer_idx: int, kv_index: int) -> None:
        super().__init__(cfg, layer_idx)
        self.kv_index = kv_index
        self.use_rope = uses_rope(cfg)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, (q_size, kv_size, _) = x.shape[0], self.split
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        v = qkv[:, q_size + kv_size :].view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = self.query_key(qkv, ctx)
        k_cache, v_cache = ctx.kv_caches[self.kv_index]
        o = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.meta, self.scale, self.window,
                                self.softcap).reshape(t, -1)  # [T, H D]
        return self.o_proj(o)


class Granite4MoeBlock(SparseMoeBlock):
    """The routed experts (`block_sparse_moe`): top-k over the float32 router logits, a softmax over the
    k chosen (transformers' GraniteMoeHybridTopKRouter), SwiGLU experts over stacked weights."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size, int(cfg.num_local_experts),
                         int(cfg.num_experts_per_tok), False)  # fmt: skip

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """x [T, H] -> [T, H] (the experts only: the layer adds the shared MLP)."""
        weights, ids = route_topk_softmax(self.gate(x), self.top_k)
        if self.counts is not None:
            flat = ids.reshape(-1)
            self.counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=self.counts.dtype))
        if self.experts.path == "triton":
            from engine.models.triton_moe import fused_experts

            return fused_experts(x, ids, weights, self.experts.gate_up_proj, self.experts.down_proj)
        return grouped_experts(x, ids, weights, self.experts.expert, self.experts.num_experts)

    def triton_experts_supported(self) -> bool:
        return True  # plain SwiGLU experts without biases: only the routing differs, done above


class Granite4DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, kind: str, kind_index: int) -> None:
        """kind_index: the layer's rank among layers of its kind (its KV entry, or its state row)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.is_attention = kind == ATTENTION
        if self.is_attention:
            self.self_attn = Granite4Attention(cfg, layer_idx, kind_index)
        else:
            self.mamba = Mamba2Mixer(cfg, kind_index)
        self.shared_mlp = GatedMLP(cfg.hidden_size, int(cfg.shared_intermediate_size))
        self.block_sparse_moe = Granite4MoeBlock(cfg) if int(getattr(cfg, "num_local_experts", 0) or 0) > 0 else None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_multiplier = float(cfg.residual_multiplier)

    def forward(self, positions, x, residual, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: returns (the MLP output, scaled, and the stream before it)."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(positions, h, ctx) if self.is_attention else self.mamba(h, ctx)
        h, residual = self.post_attention_layernorm.add_norm(h * self.residual_multiplier, residual)
        out = self.shared_mlp(h)
        if self.block_sparse_moe is not None:  # transformers adds the experts' output first
            out = self.block_sparse_moe(h) + out
        return out * self.residual_multiplier, residual


class Granite4Model(LlamaModel):
    def __init__(self, cfg, layer_cls, max_positions: int) -> None:
        nn.Module.__init__(self)  # LlamaModel's own __init__ builds one kind of layer
        check_rope_supported(cfg, max_positions)
        self.rotary = rotary_embedding(cfg, head_dim_of(cfg), max_positions)  # read only with RoPE
        self.embedding_multiplier = float(getattr(cfg, "embedding_multiplier", 1.0) or 1.0)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        types = granite4_layer_types(cfg)
        self.layers = nn.ModuleList(Granite4DecoderLayer(cfg, i, kind, types[:i].count(kind))
                                    for i, kind in enumerate(types))  # fmt: skip
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fused_decode = None  # never set: fused_decode_unsupported declines


class GraniteMoeHybridForCausalLM(MoeCausalLM, LlamaForCausalLM):
    model_cls = Granite4Model
    hybrid = True
    packed = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
    # checkpoint name part -> ours: the shared MLP's fused gate/up is our GatedMLP's as it is; the
    # experts as the files name them (transformers 5 renames them the same way when it loads)
    renames = ((".shared_mlp.input_linear.", ".shared_mlp.gate_up_proj."),
               (".shared_mlp.output_linear.", ".shared_mlp.down_proj."),
               (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
               (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
               (".block_sparse_moe.router.layer.", ".block_sparse_moe.gate."),
               (".block_sparse_moe.router.", ".block_sparse_moe.gate."))  # fmt: skip

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.logits_scaling = float(cfg.logits_scaling)

    def check_config(self, cfg) -> None:
        super().check_config(cfg)
        types = granite4_layer_types(cfg)
        if ATTENTION not in types:
            raise ValueError("layer_types: a Granite 4 model without attention layers is not supported")
        uses_rope(cfg)
        if MAMBA in types:
            if int(cfg.mamba_d_conv) < 2:
                raise ValueError(f"mamba_d_conv must be at least 2, got {cfg.mamba_d_conv!r}")
            heads, groups = int(cfg.mamba_n_heads), int(cfg.mamba_n_groups)
            if heads % groups or int(cfg.mamba_d_head) * heads != int(cfg.mamba_expand * cfg.hidden_size):
                raise ValueError("mamba_n_heads must be a multiple of mamba_n_groups, and mamba_d_head * "
                                 "mamba_n_heads equal mamba_expand * hidden_size")  # fmt: skip
            limit = tuple(getattr(cfg, "time_step_limit", None) or (0.0, math.inf))
            if limit != (0.0, math.inf):
                raise ValueError(f"time_step_limit {limit!r} is not supported (only (0, inf): transformers "
                                 "clamps dt in its chunked scan but not in its decode step)")  # fmt: skip
        if int(getattr(cfg, "num_local_experts", 0) or 0) > 0:
            top_k = int(cfg.num_experts_per_tok)
            if not 0 < top_k <= int(cfg.num_local_experts):
                raise ValueError(f"num_experts_per_tok must be in 1..{cfg.num_local_experts}, got {top_k}")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling

    def shard_sizes(self, fused: str, rows: int | None = None) -> list[int]:
        if fused == "qkv_proj":
            return next(layer.self_attn.split for layer in self.model.layers if layer.is_attention)
        return super().shard_sizes(fused, rows)

    def fused_decode_unsupported(self) -> str | None:
        return "a hybrid of Mamba2 and attention layers (a conv and SSM state per sequence)"

    def cuda_graphs_unsupported(self) -> str | None:
        return "the Mamba2 layers' state slots are gathered per step (not captured)"

    def select_experts(self, device: torch.device, dtype: torch.dtype, required: bool) -> str:
        if not self.moe_blocks():
            return "none (a dense shared MLP on every layer)"
        return super().select_experts(device, dtype, required)

    def _mixers(self) -> list[Mamba2Mixer]:
        return [layer.mamba for layer in self.model.layers if not layer.is_attention]

    def conv_state_spec(self, dtype: torch.dtype) -> ConvStateSpec | None:
        mixers = self._mixers()
        if not mixers:
            return None
        return ConvStateSpec(len(mixers), mixers[0].channels, mixers[0].width, dtype)

    def ssm_state_spec(self) -> SsmStateSpec | None:
        mixers = self._mixers()
        if not mixers:
            return None
        m = mixers[0]
        return SsmStateSpec(len(mixers), m.heads, m.head_dim, m.state_size)

    @property
    def num_kv_layers(self) -> int:
        return sum(1 for layer in self.model.layers if layer.is_attention)
