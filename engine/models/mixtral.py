"""Mixtral: Mistral's attention (a `sliding_window` on every layer when set) with a mixture-of-experts
MLP on every layer: `num_local_experts` experts of `intermediate_size`, the top-k weights renormalised
(a softmax over the chosen logits). Its checkpoints name the MLP `block_sparse_moe` and the experts'
matrices w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.moe import MoeCausalLM, SparseMoeBlock, num_experts_of
from engine.models.qwen_moe import check_moe_config


class MixtralDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.intermediate_size, num_experts_of(cfg),  # type: ignore[assignment]
                                  int(cfg.num_experts_per_tok), True)  # fmt: skip


class MixtralForCausalLM(MoeCausalLM, LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer
    renames = ((".block_sparse_moe.", ".mlp."),)

    def check_config(self, cfg) -> None:
        check_moe_config(cfg)
