"""GPT-OSS (transformers' GptOssForCausalLM, model_type gpt_oss): Llama's pre-norm layers with

- attention: q/k/v/o biases, a learned sink logit per query head (`sinks`, joining each softmax's
  denominator with no value: every attention backend takes them, engine/attention/base.py), sliding-window
  and full layers alternating (`layer_types`, engine/models/windows.py), YaRN rope (engine/models/rope.py);
- MLP: a mixture of experts on every layer: a router with a bias, top-k over its logits and a softmax over
  the k chosen logits; each expert a clamped SwiGLU with biases: gate_up = x W + b ([2I], gate and up
  interleaved: gate at the even columns), gate clamped above at `swiglu_limit`, up to +-limit,
  out = (up + 1) * gate * sigmoid(alpha * gate), then the down projection and its bias.

Expert weights stay in the checkpoint's layout (transformers' GptOssExperts): gate_up_proj [E, H, 2I],
gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H]; a GGUF file's split
gate/up/down stacks are written into those (engine/weights/gguf/gpt_oss.py). Shapes: T tokens, H hidden,
E experts, K experts per token, I an expert's width.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers import RMSNorm
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from engine.models.moe import ExpertSlot, MoeCausalLM, MoeExperts, MoeRouter, SparseMoeBlock, grouped_experts

if TYPE_CHECKING:
    from engine.lora.batch import LayerLora


def route_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, K] float32, expert ids [T, K] int64): top-k over the logits, then
    a softmax over the k chosen (transformers' GptOssTopKRouter)."""
    values, ids = torch.topk(logits.float(), top_k, dim=-1)  # [T, K], descending
    return torch.softmax(values, dim=-1), ids


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[n, 2I] with gate at the even columns, up at the odd ones -> [n, I], transformers' _apply_gate."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssRouter(MoeRouter):
    """The router's weight [E, H] and bias [E]; logits in float32."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__(hidden, num_experts)
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> logits [T, E] float32."""
        if self.invariant is not None:  # the batch-invariant mode's product (no bias in it)
            return self.invariant(x.float()) + self.bias.float()
        return F.linear(x.float(), self.weight.float(), self.bias.float())


class GptOssExperts(MoeExperts):
    """Every expert's clamped SwiGLU in the checkpoint's layout (module docstring); on the CPU,
    replace_linears turns each expert's two products into the engine's linear modules (bias included;
    role "linear": the fused silu(gate) * up of the "gate_up" role is not this activation)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, alpha: float, limit: float) -> None:
        super().__init__(hidden, intermediate, num_experts)
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * intermediate))  # [E, H, 2I]
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate))  # [E, 2I]
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))  # [E, I, H]
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))  # [E, H]

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert e over rows [n, H] -> [n, H] (transformers' arithmetic: x @ W + b)."""
        if self.gate_up is None or self.down is None:
            h = clamped_swiglu(rows @ self.gate_up_proj[e] + self.gate_up_proj_bias[e], self.alpha, self.limit)
            return h @ self.down_proj[e] + self.down_proj_bias[e]
        return self.down[e](clamped_swiglu(self.gate_up[e](rows), self.alpha, self.limit))

    def replace_linears(self, make: Callable[[torch.Tensor, torch.Tensor | None, str], nn.Module]) -> None:
        """Each expert's products by make(weight [out, in], bias, "linear")."""
        gu, gub = self.gate_up_proj.detach(), self.gate_up_proj_bias.detach()
        dn, dnb = self.down_proj.detach(), self.down_proj_bias.detach()
        self.gate_up = nn.ModuleList(make(gu[e].t().contiguous(), gub[e], "linear") for e in range(self.num_experts))
        self.down = nn.ModuleList(make(dn[e].t().contiguous(), dnb[e], "linear") for e in range(self.num_experts))
        self.fused_act = False
        empty = lambda: nn.Parameter(torch.empty(0), requires_grad=False)  # noqa: E731
        self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias = empty(), empty(), empty(), empty()


class GptOssMoeBlock(SparseMoeBlock):
    """Router (`router` in the checkpoint, `gate` here: the MoE block's name) and experts of one layer."""

    def __init__(self, cfg) -> None:
        num_experts, top_k = int(cfg.num_local_experts), int(cfg.num_experts_per_tok)
        super().__init__(cfg.hidden_size, cfg.intermediate_size, num_experts, top_k, False)
        self.gate = GptOssRouter(cfg.hidden_size, num_experts)
        self.experts = GptOssExperts(cfg.hidden_size, cfg.intermediate_size, num_experts,
                                     float(cfg.swiglu_alpha), float(cfg.swiglu_limit))  # fmt: skip

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. lora: unused (adapters on MLPs are refused for MoE models)."""
        weights, ids = route_topk_softmax(self.gate(x), self.top_k)
        if self.counts is not None:
            self.counts += torch.bincount(ids.reshape(-1), minlength=self.counts.shape[0]).to(self.counts.device)
        return grouped_experts(x, ids, weights, self.experts.expert, self.experts.num_experts)


class GptOssRMSNorm(RMSNorm):
    """transformers' GptOssRMSNorm: the weight multiplies in float32, then the cast (Llama's casts first:
    the same in float32, not in bf16), so the C++ norm kernel (Llama's rounding) is not used."""

    fusable = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class GptOssAttention(LlamaAttention):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)  # attention_bias: q/k/v and o biases
        self.sinks = nn.Parameter(torch.empty(self.num_heads))


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.mlp = GptOssMoeBlock(cfg)  # type: ignore[assignment]
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GptOssForCausalLM(MoeCausalLM, LlamaForCausalLM):
    layer_cls = GptOssDecoderLayer
    # the router is the MoE block's `gate`; a GGUF file's sinks come as `attn_sinks.weight`
    renames = ((".mlp.router.", ".mlp.gate."), (".self_attn.sinks.weight", ".self_attn.sinks"))

    def __init__(self, cfg, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        self.model.norm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def check_config(self, cfg) -> None:
        if int(getattr(cfg, "num_local_experts", 0) or 0) <= 0:
            raise ValueError("num_local_experts must be positive for GPT-OSS")
        if getattr(cfg, "attention_bias", True) is False:
            raise ValueError("attention_bias false is not supported (GPT-OSS's projections carry biases)")

    def expert_slot(self, name: str) -> ExpertSlot | None:
        """The experts' tensors: the checkpoint's four (whole, in their own layout: shard None), or a GGUF
        file's split stacks (renamed by engine/weights/gguf/tensors.py): `experts.gate_proj.weight`
        [E, I, H] (shard 0 of gate_up_proj), `up_proj` (shard 1), `down_proj.weight` [E, H, I], and
        their biases [E, I] / [E, H]."""
        m = _CHECKPOINT_EXPERTS.match(name)
        if m is not None:
            return ExpertSlot(name, None, None)
        m = _GGUF_EXPERTS.match(name)
        if m is None:
            return None
        matrix, kind = m.group(2), m.group(3)
        param = f"{m.group(1)}.{'down_proj' if matrix == 'down_proj' else 'gate_up_proj'}"
        return ExpertSlot(param + ("_bias" if kind == "bias" else ""), None, int(matrix == "up_proj"))

    def expert_destination(self, param: torch.Tensor, slot: ExpertSlot) -> torch.Tensor:
        """The view of an expert parameter (checkpoint layout) that a tensor of `slot` fills: the whole of
        it, or a GGUF stack's: gate (shard 0) at the even columns of gate_up, up (1) at the odd ones,
        transposed ([E, I, H] of [E, H, 2I]; a bias [E, I] of [E, 2I]); down [E, H, I] of [E, I, H]."""
        if slot.shard is None:
            return param
        if slot.param.endswith("down_proj"):
            return param.transpose(1, 2)
        if slot.param.endswith("down_proj_bias"):
            return param
        if slot.param.endswith("gate_up_proj"):
            return param.unflatten(2, (-1, 2))[..., slot.shard].transpose(1, 2)  # [E, I, H]
        return param.unflatten(1, (-1, 2))[..., slot.shard]  # gate_up_proj_bias: [E, I]

    def expert_missing(self, param: str, shape: torch.Size, loaded: set[str]) -> list[str]:
        if param in loaded:
            return []
        shards = 2 if "gate_up_proj" in param else 1
        return [tag for s in range(shards) if (tag := f"{param}#*.{s}") not in loaded]


# the checkpoint's expert tensors (transformers' names), and a GGUF file's after its renames
_CHECKPOINT_EXPERTS = re.compile(r"^.*\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_GGUF_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")
