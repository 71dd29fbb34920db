"""OLMoE: Llama's pre-norm layers with an RMSNorm over the whole query and key projections (OLMo 2's
q/k norm, but Llama's norm arithmetic: cast, then scale) and a mixture-of-experts MLP on every layer
(`num_experts` experts of `intermediate_size`, top-k softmax routing, `norm_topk_prob`)."""

from __future__ import annotations

from engine.models.layers import RMSNorm
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.moe import MoeCausalLM, SparseMoeBlock, num_experts_of
from engine.models.olmo2 import Olmo2Attention
from engine.models.qwen_moe import check_moe_config


class OlmoeAttention(Olmo2Attention):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        q_size, kv_size, _ = self.split
        self.q_norm = RMSNorm(q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(kv_size, cfg.rms_norm_eps)


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = OlmoeAttention

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.intermediate_size, num_experts_of(cfg),  # type: ignore[assignment]
                                  int(cfg.num_experts_per_tok), bool(cfg.norm_topk_prob))  # fmt: skip


class OlmoeForCausalLM(MoeCausalLM, LlamaForCausalLM):
    layer_cls = OlmoeDecoderLayer

    def check_config(self, cfg) -> None:
        check_moe_config(cfg)
        if getattr(cfg, "clip_qkv", None) is not None:
            raise ValueError(f"clip_qkv {cfg.clip_qkv!r} is not supported (only null, as OLMoE-1B-7B has)")
