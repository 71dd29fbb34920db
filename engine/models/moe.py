"""Mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral): a float32 router picks each token's
top-k experts, tokens are grouped by expert, and each expert that received tokens runs one SwiGLU
product over all of them, reading its weights once per step.

Shapes: T = tokens of the step, H = hidden, E = experts, K = experts per token (top-k), I = an expert's
intermediate size. Expert weights are stacked: gate_up [E, 2I, H] (gate rows first, then up, as
transformers 5 fuses them), down [E, H, I].

Routing is transformers' arithmetic: softmax over all E logits in float32, top-k, and (norm_topk_prob;
always for Mixtral) the k weights divided by their sum, which equals a softmax over the k logits. The
logits are computed in float32 from the float32 router weight and hidden state (transformers computes
them in the model dtype: the same in float32, a little more precise in bf16).

The weighted expert outputs are summed back into their tokens with index_add_ over the rows sorted by
expert id (a stable sort): each token's contributions are added in ascending expert order, the order
transformers' per-expert loop adds them, whatever the batch. On the CPU index_add_ runs its rows in
order; CUDA's may use atomics (the order is not fixed there).

On the CPU, once replace_linears has made each expert two of the engine's linear modules, the routed
experts of a step run in one C++ call (engine/models/cpu_moe.py: the same arithmetic and the same sum
back, so the same bits as the loop here), up to the rows the modules' kernels take; the loop is the
fallback (MoeCausalLM.select_experts says which runs).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.cpu_moe import CpuExperts, cpu_experts
from engine.models.layers import GatedMLP, silu_mul

if TYPE_CHECKING:
    from engine.lora.batch import LayerLora

log = logging.getLogger("tokenmill.engine")
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # triton_moe.DTYPES, without importing triton


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype) -> (weights [T, K] float32, expert ids [T, K] int64), each row's
    experts in descending weight (torch.topk's order; ties: the lower id first)."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E] float32
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]  # (expert e, its rows [n, H]) -> [n, H]


def stacked_expert(gate_up: torch.Tensor, down: torch.Tensor) -> ExpertFn:
    """Expert e's SwiGLU over stacked weights gate_up [E, 2I, H], down [E, H, I], with F.linear."""
    return lambda e, rows: F.linear(silu_mul(F.linear(rows, gate_up[e])), down[e])


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert: ExpertFn,
                    num_experts: int) -> torch.Tensor:
    """sum_k weights[t, k] * expert(ids[t, k], x[t]) for every token: x [T, H], ids/weights [T, K]
    -> [T, H] in x's dtype.

    The T*K (token, expert) pairs are sorted by expert id (stable: within an expert, in token order);
    each expert with pairs runs once over all its rows (one host sync for the per-expert counts, a
    loop over experts, never over tokens); the rows, scaled by their routing weight in x's dtype, go
    back to their tokens with index_add_ in sorted order."""
    k = ids.shape[1]
    flat = ids.reshape(-1)  # [T K]
    order = torch.argsort(flat, stable=True)  # [T K]: pairs grouped by expert, ascending
    token_of = torch.div(order, k, rounding_mode="floor")  # [T K]: each sorted pair's token
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # pairs per expert (one sync)
    rows = x[token_of]  # [T K, H]
    out = torch.empty_like(rows)  # [T K, H]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        out[start : start + n] = expert(e, rows[start : start + n])  # [n, H]
        start += n
    out = out * weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)  # [T K, H]
    return torch.zeros_like(x).index_add_(0, token_of, out)  # [T, H]


def dense_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """grouped_experts computed one token and one expert at a time (tests)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in sorted(range(ids.shape[1]), key=lambda j: int(ids[t, j])):  # ascending expert id
            e = int(ids[t, j])
            h = silu_mul(F.linear(x[t : t + 1], gate_up[e]))
            out[t] += (F.linear(h, down[e]) * weights[t, j].to(x.dtype))[0]
    return out


class MoeRouter(nn.Module):
    """The router's weight [E, H] (not an nn.Linear: the linear replacements, packing and INT8 leave
    it alone; its logits are float32)."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        # the batch-invariant mode's float32 product over the float32 weight (engine/weights/cpu_weights.py)
        self.invariant: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> logits [T, E] float32."""
        if self.invariant is not None:
            return self.invariant(x.float())
        return F.linear(x.float(), self.weight.float())


class MoeExperts(nn.Module):
    """Every expert's SwiGLU weights, stacked as loaded; on the CPU, replace_linears turns each expert's
    matrices into the engine's linear modules (the small-batch kernels, oneDNN, INT8: whatever the
    dense linears get), after which the stacks are dropped."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))  # [E, H, I]
        self.gate_up: nn.ModuleList | None = None  # per expert [2I, H] linears (replace_linears)
        self.down: nn.ModuleList | None = None  # per expert [H, I]
        self.fused_act = False  # every gate_up module computes silu(gate) * up itself (silu_mul)
        self.path = "torch"  # "triton": triton_moe.fused_experts over the stacks (MoeCausalLM.select_experts)
        self.cpu: CpuExperts | None = None  # the C++ grouped experts over the replaced linears (use_cpu_kernel)

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert e's SwiGLU over rows [n, H] -> [n, H]."""
        if self.gate_up is None or self.down is None:
            return F.linear(silu_mul(F.linear(rows, self.gate_up_proj[e])), self.down_proj[e])
        gate_up = self.gate_up[e]
        h = gate_up.silu_mul(rows) if self.fused_act else silu_mul(gate_up(rows))  # [n, I]
        return self.down[e](h)

    def replace_linears(self, make: Callable[[torch.Tensor, torch.Tensor | None, str], nn.Module]) -> None:
        """Each expert's matrices by make(weight, None, role) (LlamaForCausalLM.replace_linears' roles)."""
        gate_up, down = self.gate_up_proj.detach(), self.down_proj.detach()
        self.gate_up = nn.ModuleList(make(gate_up[e], None, "gate_up") for e in range(self.num_experts))
        self.down = nn.ModuleList(make(down[e], None, "linear") for e in range(self.num_experts))
        self.fused_act = all(hasattr(m, "silu_mul") for m in self.gate_up)
        # the stacks' memory goes where no module kept a view of it (a packed, quantized or kernel copy)
        self.gate_up_proj = nn.Parameter(torch.empty(0), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(0), requires_grad=False)
        self.cpu = None

    def use_cpu_kernel(self) -> str | None:
        """Run the replaced linears through the C++ grouped experts (engine/models/cpu_moe.py) where they
        can; -> None, or why not (the loop over experts stays)."""
        if self.gate_up is None or self.down is None:
            return "the experts are not replaced by the engine's linears"
        found = cpu_experts(list(self.gate_up), list(self.down))
        if isinstance(found, str):
            return found
        self.cpu = found
        return None


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's sigmoid gate on the shared expert: weight [1, H] (kept out of the linear replacements)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight))  # [T, 1]


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: routed experts, plus (Qwen2-MoE) a shared expert scaled by its gate."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, normalize: bool,
                 shared_intermediate: int = 0) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{num_experts} (the experts), got {top_k}")
        self.top_k, self.normalize = top_k, normalize
        self.gate = MoeRouter(hidden, num_experts)
        self.experts = MoeExperts(hidden, intermediate, num_experts)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: SharedExpertGate | None = None
        if shared_intermediate:
            self.shared_expert = GatedMLP(hidden, shared_intermediate)
            self.shared_expert_gate = SharedExpertGate(hidden)
        self.counts: torch.Tensor | None = None  # tokens routed to each expert so far [E] (count_tokens)

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. lora: unused (adapters on MLPs are refused for MoE models, engine/lora/shapes.py)."""
        weights, ids = route(self.gate(x), self.top_k, self.normalize)
        if self.counts is not None:  # on ids' device, no host sync (bincount on CUDA reads its max back)
            flat = ids.reshape(-1)
            self.counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=self.counts.dtype))
        if self.experts.path == "triton":
            from engine.models.triton_moe import fused_experts

            out = fused_experts(x, ids, weights, self.experts.gate_up_proj, self.experts.down_proj)
        elif self.experts.cpu is not None and self.experts.cpu.applies(x):
            out = self.experts.cpu(x, ids, weights)
        else:
            out = grouped_experts(x, ids, weights, self.experts.expert, self.experts.num_experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + self.shared_expert_gate(x) * self.shared_expert(x)
        return out

    def triton_experts_supported(self) -> bool:
        """Whether forward's path "triton" computes this block's experts: plain SwiGLU without biases. A
        subclass with biases or another activation (GPT-OSS) says so by overriding this once its forward
        passes them to triton_moe.fused_experts (gate_up_bias, down_bias, ExpertAct)."""
        return type(self) is SparseMoeBlock and type(self.experts) is MoeExperts

    def cpu_experts_supported(self) -> bool:
        """Whether forward runs the C++ grouped experts (plain SwiGLU, this class's forward), as above."""
        return type(self) is SparseMoeBlock and type(self.experts) is MoeExperts

    def count_tokens(self, device: torch.device | str = "cpu") -> None:
        """Keep a running count of the tokens each expert receives (debugging: expert_counts), on the
        device the routing runs on."""
        self.counts = torch.zeros(self.experts.num_experts, dtype=torch.int64, device=device)


@functools.cache  # one answer per device and process: the probe is not repeated per layer or engine
def triton_experts_reason(device: torch.device) -> str | None:
    """None when triton_moe's grouped GEMMs can run on `device`, else why not: CUDA only (the CPU runs
    its own linears; the interpreter would be far slower), triton imports, and builds and launches a
    kernel there (the attention backend's probe)."""
    if device.type != "cuda":
        return f"the Triton experts run on CUDA only, not {device.type}"
    from engine.attention import triton_unavailable_reason

    reason = triton_unavailable_reason(device)
    if reason is None:
        try:
            from engine.models import triton_moe  # noqa: F401
        except Exception as exc:  # ImportError, or a broken install
            reason = f"{type(exc).__name__}: {exc}"
    return reason


@dataclass(frozen=True)
class ExpertSlot:
    """Where a checkpoint tensor of the experts goes: the stacked parameter, the expert (None: every
    expert, a stacked checkpoint tensor) and the shard of its rows (gate 0, up 1; down 0; None: every
    shard, a fused gate_up tensor)."""

    param: str
    expert: int | None
    shard: int | None

    @property
    def tag(self) -> str:
        """The loader's loaded-key tag: the parameter, or "#expert.shard" with "*" for every expert."""
        if self.shard is None:
            return self.param
        return f"{self.param}#{'*' if self.expert is None else self.expert}.{self.shard}"


# per-expert checkpoint names: Qwen/OLMoE gate_proj/up_proj/down_proj, Mixtral w1 (gate), w3 (up), w2 (down)
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
# every expert's matrix stacked [E, rows, cols]: transformers 5's fused gate_up_proj / down_proj, and the
# stacked gate_proj / up_proj / down_proj of a GGUF file (ffn_gate_exps, ffn_up_exps, ffn_down_exps)
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")
_SHARD = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
          "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", 0), "w2": ("down_proj", 0)}  # fmt: skip


def expert_slot(name: str) -> ExpertSlot | None:
    """The slot of a checkpoint tensor name (after the model's renames), None when it is no expert weight:
    `...experts.3.gate_proj.weight` (transformers 4 and the files transformers 5 writes), the fused
    `...experts.gate_up_proj` [E, 2I, H] / `...experts.down_proj` [E, H, I] (transformers 5 in memory),
    or a stacked `...experts.gate_proj.weight` [E, I, H] (GGUF)."""
    m = _PER_EXPERT.match(name)
    if m is not None:
        param, shard = _SHARD[m.group(3)]
        return ExpertSlot(f"{m.group(1)}.{param}", int(m.group(2)), shard)
    m = _STACKED.match(name)
    if m is not None:
        if m.group(2) == "gate_up_proj":
            return ExpertSlot(f"{m.group(1)}.gate_up_proj", None, None)
        param, shard = _SHARD[m.group(2)]
        return ExpertSlot(f"{m.group(1)}.{param}", None, shard)
    return None


def expert_missing(param: str, shape: torch.Size, loaded: set[str]) -> list[str]:
    """The tags of a stacked expert parameter [E, rows, cols] not yet covered by `loaded` (whole, per
    shard for every expert, or per expert and shard)."""
    if param in loaded:
        return []
    missing = []
    for s in range(2 if param.endswith("gate_up_proj") else 1):
        if f"{param}#*.{s}" not in loaded:
            missing += [tag for e in range(shape[0]) if (tag := f"{param}#{e}.{s}") not in loaded]
    return missing


def expert_destination(param: torch.Tensor, slot: ExpertSlot) -> torch.Tensor:
    """The view of a stacked parameter [E, R, C] that a checkpoint tensor of `slot` fills."""
    if slot.shard is None:
        return param
    rows = param.shape[1] // (2 if slot.param.endswith("gate_up_proj") else 1)
    if slot.expert is None:
        return param.narrow(1, slot.shard * rows, rows)
    return param[slot.expert].narrow(0, slot.shard * rows, rows)


def num_experts_of(cfg) -> int:
    """Routed experts per sparse layer: `num_experts` (Qwen, OLMoE) or `num_local_experts` (Mixtral)."""
    return int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0)


class MoeCausalLM:
    """What a mixture-of-experts model class adds to LlamaForCausalLM (listed first among its bases)."""

    # checkpoint prefixes renamed before the lookup (Mixtral: block_sparse_moe -> mlp)
    renames: tuple[tuple[str, str], ...] = ()

    def checkpoint_name(self, name: str) -> str:
        for old, new in self.renames:
            name = name.replace(old, new)
        return name

    def expert_slot(self, name: str) -> ExpertSlot | None:
        return expert_slot(name)

    def fused_decode_unsupported(self) -> str | None:
        return "mixture-of-experts MLPs (tokens routed to experts)"

    def cuda_graphs_unsupported(self) -> str | None:
        return "the experts' token counts are read on the host each step (a sync a graph cannot hold)"

    def moe_blocks(self) -> list[SparseMoeBlock]:
        assert isinstance(self, nn.Module)
        return [m for m in self.modules() if isinstance(m, SparseMoeBlock)]

    def select_experts(self, device: torch.device, dtype: torch.dtype, required: bool) -> str:
        """Put every sparse layer on the Triton grouped GEMMs (engine/models/triton_moe.py) where they can
        run (CUDA, triton ready, the stacks kept: no linear replaced them), else keep the PyTorch loop over
        experts; -> the path, for the start-up log. required (TOKENMILL_REQUIRE_KERNELS=1): on CUDA, the
        loop is a RuntimeError instead."""
        blocks = self.moe_blocks()
        if any(b.experts.gate_up is not None for b in blocks):
            return self._select_cpu_experts(blocks)
        if not all(b.triton_experts_supported() for b in blocks):
            return "torch loop over experts (experts with their own arithmetic)"
        reason = triton_experts_reason(device) if dtype in TRITON_DTYPES else f"no Triton experts for {dtype}"
        if reason is None:
            for b in blocks:
                b.experts.path = "triton"
            return "triton grouped GEMM"
        if required and device.type == "cuda":
            raise RuntimeError(f"Triton MoE experts unavailable and TOKENMILL_REQUIRE_KERNELS=1: {reason}")
        if device.type == "cuda":
            log.warning("MoE experts: no Triton grouped GEMM (%s); the PyTorch loop over experts runs", reason)
        return f"torch loop over experts ({reason})"

    @staticmethod
    def _select_cpu_experts(blocks: list[SparseMoeBlock]) -> str:
        """The replaced linears' path: the C++ grouped experts in every block that can take them, else the
        loop over per-expert linears (the first reason). A moe group that does not load is
        KernelsUnavailable under TOKENMILL_REQUIRE_KERNELS=1 (cpu_kernels.load)."""
        reasons = [b.experts.use_cpu_kernel() if b.cpu_experts_supported() else "experts with their own arithmetic"
                   for b in blocks]
        used = [b.experts.cpu for b in blocks if b.experts.cpu is not None]
        if not used:
            return f"per-expert linears, a loop over experts ({reasons[0]})"
        path = torch.ops.tokenmill.moe_path(used[0].kind)
        rows = min(c.max_rows for c in used)
        limit = "every step" if rows >= 1 << 62 else f"steps of up to {rows} rows, per-expert linears above"
        text = f"C++ grouped experts (cpu_moe.cpp, {used[0].kind} {path}) for {limit}"
        if len(used) < len(blocks):
            text += f"; {len(blocks) - len(used)} layer(s) loop over per-expert linears ({next(r for r in reasons if r)})"
        return text

    def expert_counts(self) -> list[list[int]]:
        """Tokens each expert received so far, per sparse layer (after count_expert_tokens)."""
        return [[] if b.counts is None else b.counts.tolist() for b in self.moe_blocks()]

    def count_expert_tokens(self, device: torch.device | str = "cpu") -> None:
        for b in self.moe_blocks():
            b.count_tokens(device)
