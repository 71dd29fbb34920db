"""Building blocks shared by the Llama-family models. Math mirrors transformers' so float32
results match token for token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from engine.lora.batch import LayerLora, LoraBatch
    from engine.state.batch import StateBatch


@dataclass
class ForwardContext:
    """Per-step state every attention layer needs."""

    backend: AttentionBackend
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    # A model with several KV-cache groups (engine/kv/groups.py): per group, its metadata (its block tables
    # and slots; group_metas[0] is `meta`), each layer reading its group's (LlamaAttention.kv_group).
    # Empty: every layer reads `meta` (one group, the draft model, profiling).
    group_metas: tuple[AttentionMetadata, ...] = ()
    # Rotary tables gathered once per step for the packed positions: [T, 1, head_dim] each.
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    # The step's rows by LoRA adapter (engine/lora/batch.py); None: every row runs on the base model.
    lora: LoraBatch | None = None
    # Sliding-window layers' own rotary tables (Gemma 3's rope_local_base_freq), as cos/sin; None: the
    # same as every layer's.
    rope_local: tuple[torch.Tensor, torch.Tensor] | None = None
    # LongRoPE: [T] int64, 1 where a token below the switch takes the long factors (its sequence is longer
    # than the switch; engine/models/rope.py LongRopeEmbedding); None: no such token this step.
    rope_long: torch.Tensor | None = None
    # A hybrid model's per-sequence recurrent state for this step (engine/state/batch.py: each sequence's
    # rows and state slot); None: a model without one (or a profiling pass)
    state: StateBatch | None = None


class RMSNorm(nn.Module):
    fusable = True  # the C++ kernel rounds as this class does (OLMo 2's norm: False)

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        # The fused C++ kernel (engine/kernels/csrc/cpu_layers.cpp); set by LlamaForCausalLM.use_cpu_kernels.
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return torch.ops.tokenmill.rms_norm(x.contiguous(), self.weight, self.eps)
        # Normalise in float32, scale in the model dtype (as transformers does).
        dtype = x.dtype
        xf = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * xf.to(dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after adding x (x itself when residual is None), and its norm:
        returns (norm, stream). The fused kernel updates `residual` in place."""
        if residual is None:
            return self(x), x
        if self.fused:
            return torch.ops.tokenmill.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self(residual), residual


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    # LongRoPE's switch position (engine/models/rope.py LongRopeEmbedding); None: one set of factors
    switch: int | None = None

    def __init__(self, inv_freq_fn, max_positions: int) -> None:
        super().__init__()
        # Called at build time: the module may be constructed on the meta device.
        self.inv_freq_fn = inv_freq_fn  # () -> (inv_freq [head_dim / 2] float32, scaling)
        self.max_positions = max_positions
        self.cos = self.sin = torch.empty(0)

    def frequencies(self) -> torch.Tensor:
        """Angles [rows, rotary_dim / 2], float32, on the CPU; sets self.scaling."""
        inv_freq, self.scaling = self.inv_freq_fn()
        pos = torch.arange(self.max_positions, dtype=torch.float32)
        return pos[:, None] * inv_freq.float()[None, :]  # [max_pos, head_dim / 2]

    def build(self, dtype: torch.dtype, device: torch.device) -> None:
        """Compute the tables; called after the model is materialised."""
        with torch.device("cpu"):
            freqs = self.frequencies()
        emb = torch.cat((freqs, freqs), dim=-1).to(device)  # [rows, head_dim]
        self.cos = (emb.cos() * self.scaling).to(dtype)
        self.sin = (emb.sin() * self.scaling).to(dtype)

    def lookup(self, positions: torch.Tensor, long_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the packed positions: [T, 1, head_dim] each (shared by all layers). `long_rows`
        (LongRoPE only; [T] 0/1) is ignored here."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    # q: [T, heads, d], k: [T, kv_heads, d]; cos/sin: [T, 1, d]
    return rotate(q, cos, sin), rotate(k, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x: [T, heads, d] (any number of heads: q and k can go through together)."""
    return x * cos + _rotate_half(x) * sin


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool) -> torch.Tensor:
    """rotate() in place when the C++ kernel is on (same roundings, one pass, no temporaries)."""
    if not fused:
        return rotate(x, cos, sin)
    torch.ops.tokenmill.rotary_inplace(x, cos, sin)
    return x


def rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    """RoPE on the first `dim` of each head's d values (cos/sin: [T, 1, dim]); the rest pass as they are."""
    return torch.cat((rotate(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gu = [gate | up] ([T, 2I]): bf16 on the CPU through tokenmill::silu_mul where
    the small-batch kernels built (the fused gate/up product's arithmetic, as the C++ decode loop's
    LoRA steps: engine/kernels/csrc/cpu_decode.cpp makes the same choice), else PyTorch's silu and mul."""
    if gu.device.type == "cpu" and gu.dtype == torch.bfloat16 and gu.stride(-1) == 1 and hasattr(torch.ops.tokenmill, "silu_mul"):
        return torch.ops.tokenmill.silu_mul(gu.reshape(-1, gu.shape[-1])).view(*gu.shape[:-1], gu.shape[-1] // 2)
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU with gate and up projections fused into one matmul."""

    activation = "silu"  # the gate's: replace_linears gives only silu MLPs the fused silu(gate) * up

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        # gate_up_proj.silu_mul(x) gives silu(gate) * up in one product (engine/models/cpu_linear.py);
        # set by LlamaForCausalLM.replace_linears.
        self.fused_act = False

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        """lora: this layer's adapter deltas, added to the gate/up product before the activation and
        to the down product (the fused activation is skipped: it never shows the product)."""
        if lora is None:
            if self.fused_act:
                return self.down_proj(self.gate_up_proj.silu_mul(x))
            return self.down_proj(silu_mul(self.gate_up_proj(x)))
        h = silu_mul(lora.add("gate_up", x, self.gate_up_proj(x)))
        return lora.add("down", h, self.down_proj(h))
