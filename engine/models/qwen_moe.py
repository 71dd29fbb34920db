"""Qwen3-MoE and Qwen2-MoE: Qwen3's (per-head q/k norm) and Qwen2's (q/k/v biases) attention with a
mixture-of-experts MLP (engine/models/moe.py) on the sparse layers: layer i is sparse unless it is in
`mlp_only_layers`, when (i + 1) is a multiple of `decoder_sparse_step`; the other layers keep a dense
SwiGLU of `intermediate_size`. Experts are `moe_intermediate_size` wide, top-k softmax routing with
`norm_topk_prob`. Qwen2-MoE adds to every sparse MLP a shared expert (`shared_expert_intermediate_size`)
scaled by sigmoid(shared_expert_gate . x)."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MoeCausalLM, SparseMoeBlock, num_experts_of
from engine.models.qwen2 import Qwen2DecoderLayer
from engine.models.qwen3 import Qwen3DecoderLayer


def is_sparse(cfg, layer_idx: int) -> bool:
    """transformers' rule for Qwen2-MoE / Qwen3-MoE layers."""
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    return (layer_idx not in (getattr(cfg, "mlp_only_layers", None) or []) and num_experts_of(cfg) > 0
            and (layer_idx + 1) % step == 0)  # fmt: skip


def sparse_block(cfg, shared_intermediate: int = 0) -> SparseMoeBlock:
    return SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, num_experts_of(cfg), int(cfg.num_experts_per_tok),
                          bool(cfg.norm_topk_prob), shared_intermediate)  # fmt: skip


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        if is_sparse(cfg, layer_idx):
            self.mlp = sparse_block(cfg)  # type: ignore[assignment]


class Qwen2MoeDecoderLayer(Qwen2DecoderLayer):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        if is_sparse(cfg, layer_idx):
            self.mlp = sparse_block(cfg, int(cfg.shared_expert_intermediate_size))  # type: ignore[assignment]


def check_moe_config(cfg) -> None:
    """ValueError naming a routing key this engine does not implement."""
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (the experts are SwiGLU: silu)")
    if num_experts_of(cfg) <= 0:
        raise ValueError("num_experts must be positive for a mixture-of-experts model")


class Qwen3MoeForCausalLM(MoeCausalLM, LlamaForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer

    def check_config(self, cfg) -> None:
        check_moe_config(cfg)


class Qwen2MoeForCausalLM(MoeCausalLM, LlamaForCausalLM):
    layer_cls = Qwen2MoeDecoderLayer

    def check_config(self, cfg) -> None:
        check_moe_config(cfg)
        if getattr(cfg, "qkv_bias", True) is False:
            raise ValueError("qkv_bias false is not supported (Qwen2-MoE's q/k/v projections carry biases)")
