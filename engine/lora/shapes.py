"""The base model's LoRA-targetable projections and their sizes, from its HF config (torch-free).

Our models fuse q/k/v into `qkv` and gate/up into `gate_up` (engine/models/llama.py); an adapter's
per-projection A/B are fused the same way (engine/lora/adapter.py), each shard at its row offset.
"""

from __future__ import annotations

from dataclasses import dataclass

# PEFT's module name -> (our fused module, shard index in it)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
    # Phi-3's checkpoint (and so its PEFT adapters) already fuse them: one shard each
    "qkv_proj": ("qkv", 0),
    "gate_up_proj": ("gate_up", 0),
}
FUSED = ("qkv", "o", "gate_up", "down")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must fit: layer count, and each projection's (in_features, out_features)."""

    num_layers: int
    projections: dict[str, tuple[int, int]]  # PEFT module name -> (in, out)
    # a mixture-of-experts model (engine/models/moe.py): adapters on attention only (its MLPs are experts,
    # or dense/shared ones beside them; neither takes a delta), `projections` lists those
    moe: bool = False

    def shards(self, fused: str) -> list[tuple[str, int]]:
        """(PEFT name, output size) of each shard of a fused module, in row order."""
        return [(name, self.projections[name][1]) for name, (f, _) in TARGETS.items()
                if f == fused and name in self.projections]  # fmt: skip

    def out_features(self, fused: str) -> int:
        return sum(size for _, size in self.shards(fused))

    def in_features(self, fused: str) -> int:
        return self.projections[self.shards(fused)[0][0]][0]

    @classmethod
    def from_hf_config(cls, cfg) -> BaseShapes:
        hidden = int(cfg.hidden_size)
        heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        inter = int(cfg.intermediate_size)
        q, kv = heads * head_dim, kv_heads * head_dim
        if int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0) > 0:
            return cls(int(cfg.num_hidden_layers), {
                "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            }, moe=True)  # fmt: skip
        if "Phi3ForCausalLM" in (getattr(cfg, "architectures", None) or []):  # fused in the checkpoint
            return cls(int(cfg.num_hidden_layers), {
                "qkv_proj": (hidden, q + 2 * kv), "o_proj": (q, hidden), "gate_up_proj": (hidden, 2 * inter),
                "down_proj": (inter, hidden),
            })  # fmt: skip
        return cls(int(cfg.num_hidden_layers), {
            "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
        })  # fmt: skip
