"""The decoder stack of a decode-only CPU step in one C++ call (engine/kernels/csrc/cpu_decode.cpp).

The Python layers make about 13 calls a layer (norms, linears, rotary, the KV store, the attention
kernels, views), ~400 for a 30-layer model: 2-3 ms of interpreter and dispatcher time a step, a fifth
of a batch-1 decode step. `FusedDecode` hands the same work to one C++ loop that makes the same calls
to the same kernels in the same order, so outputs are bit-identical to the Python layers (LoRA deltas
included, in float32 and bf16: the same tokenmill::lora_add_ calls the Python layers make). It applies
to decode-only steps on the `cpu` attention backend whose linears all run as one kernel each at the
step's row count (an INT8 or GGUF-block weight past its kernel's rows is dequantized in Python, and a
GGUF weight whose shards hold several types is several calls: those steps keep the Python layers). What each linear runs is decided per row count, once (`_plan`).

Gemma 2/3 layers (engine/models/gemma.py) run the same loop with their own layer shape (`gemma`): (1 + weight)
RMSNorms in float32 before and after attention and the MLP (and on Q/K heads: Gemma 3), GeGLU, the
attention-logit soft-cap (Gemma 2), and the local layers' own RoPE tables (Gemma 3); each norm's 1 + weight is
added once here in float32 (what GemmaRMSNorm adds at each call: the same bits). The embedding scale and the
final soft-cap stay outside the layers (the model's embed and compute_logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.lora.batch import CPP_DTYPES, LoraBatch, kernel_available
from engine.models.cpu_linear import GemvF32Linear, GemvLinear, Int8Linear
from engine.models.gguf_linear import GGMLLinear, GGMLWeight
from engine.models.invariant_linear import TiledLinear
from engine.models.layers import ForwardContext
from engine.models.packed_linear import PackedLinear

# cpu_decode.cpp Kind and Slot: how a linear runs; per layer, the optional tensors in this order.
PLAIN, ONEDNN, GEMV, GEMV_SILU, GEMV_F32, GEMV_BLOCKED, GEMV_SPLIT, GGML, GGML_Q8 = 0, 1, 2, 3, 4, 5, 6, 7, 8
LAYER_SLOTS = ("in_norm", "post_norm", "q_norm", "k_norm", "qkv_w", "qkv_scales", "qkv_bias", "o_w", "o_scales",
               "o_bias", "gu_w", "gu_scales", "gu_bias", "down_w", "down_scales", "down_bias",
               "pre_ff_norm", "post_ff_norm")  # fmt: skip
LORA_MODULES = ("qkv", "o", "gate_up", "down")  # the adapted linears of a layer, in cpu_decode.cpp's order


@dataclass(frozen=True)
class _Linear:
    kind: int
    weight: torch.Tensor
    scales: torch.Tensor | None
    bias: torch.Tensor | None
    n: int  # out features
    k: int  # in features
    ggml_type: int = 0  # the blocks' ggml type id (GGML kinds)


@dataclass(frozen=True)
class _Plan:
    """The C++ call's per-layer arguments for one row count."""

    weights: list[torch.Tensor | None]  # LAYER_SLOTS per layer
    kinds: list[int]  # qkv, o, gate/up, down per layer
    shapes: list[int]  # (n, k) of each, per layer
    ggml_types: list[int]  # each one's ggml type id (GGML kinds; 0 otherwise), per layer


class FusedDecode:
    """Runs LlamaModel's layer loop in C++ for the steps it can (see the module docstring)."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers
        attn = layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = attn.scale
        self.qk_norm = attn.qk_norm
        # per layer, its sliding window (0: full attention)
        self.windows = [layer.self_attn.window or 0 for layer in layers]
        # Gemma 2/3 layers (four (1 + weight) norms, GeGLU); the attention-logit soft-cap, one for every layer
        # (0.0: none; LlamaForCausalLM.fused_decode_unsupported declines other soft-capped models)
        self.gemma = hasattr(layers[0], "pre_feedforward_layernorm")
        self.softcap = attn.softcap or 0.0
        # per layer, 1 where it takes the local RoPE tables (Gemma 3's sliding layers, ctx.rope_local)
        self.local_rope = [int(getattr(layer.self_attn, "local_rope", False)) for layer in layers]
        self._norms: dict[int, torch.Tensor] = {}  # id of a Gemma norm's weight -> its 1 + weight in float32
        self.groups = [layer.self_attn.kv_group for layer in layers]  # per layer, its KV-cache group
        self.eps = layers[0].input_layernorm.eps
        self.fused_norm = layers[0].input_layernorm.fused
        self._plans: dict[int, _Plan | None] = {}  # row count -> plan (None: the Python layers)
        self._lora_plans: dict[int, _Plan | None] = {}  # the same for steps with adapter rows (no GEMV_SILU)
        self._lora_set: tuple[list, torch.ScriptObject] | None = None  # _lora_operands' last

    @staticmethod
    def available() -> bool:
        # the loop calls the attention and layer groups' ops (and the linear group's, where its plan says)
        from engine.kernels import cpu_kernels
        return all(cpu_kernels.load(group) is None for group in ("decode", "attention", "layers"))

    def run(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x, residual) after the last layer, as the Python loop leaves them; None when this step is
        not one the C++ loop takes. x: [B, hidden] embeddings; ctx.cos/sin set."""
        meta = ctx.meta
        lora = ctx.lora
        # adapter deltas go inside the linears: the C++ loop adds them with tokenmill::lora_add_
        # (float32, bf16); otherwise the Python layers do
        if lora is not None and (x.dtype not in CPP_DTYPES or not kernel_available()):
            return None
        if ctx.backend.name != "cpu" or getattr(meta, "prefills", True) or meta.num_decodes != x.shape[0]:
            return None
        # with adapter rows the gate/up product is a plain one (the delta goes in before the activation)
        plans = self._plans if lora is None else self._lora_plans
        plan = plans.get(x.shape[0], False)
        if plan is False:
            plan = plans[x.shape[0]] = self._plan(x.shape[0], fused_act=lora is None)
        if plan is None:
            return None
        lora_set = self._lora_operands(lora) if lora is not None else None
        nd = meta.num_decodes
        k_caches = [k for k, _ in ctx.kv_caches]
        v_caches = [v for _, v in ctx.kv_caches]
        slots, tables = self._group_operands(ctx, nd)
        out = torch.ops.tokenmill.decode_layers(
            x, ctx.cos, ctx.sin, k_caches, v_caches, slots, tables,
            meta.decode_lens, meta.block_size, meta.decode_ctx, self.scale, plan.weights, plan.kinds, plan.shapes,
            self.heads, self.kv_heads, self.head_dim, self.eps, self.fused_norm, self.qk_norm,
            lora_set, None if lora is None else lora.slots, self.windows, plan.ggml_types,
            self.gemma, self.softcap, *(ctx.rope_local or (None, None)), self.local_rope,
        )  # fmt: skip
        return out[0], out[1]

    def _group_operands(self, ctx: ForwardContext, nd: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, the slot mapping and [nd, width] block tables of its KV-cache group (engine/kv/groups.py;
        every group's rows are the same decodes, so the lengths and the padded context are shared)."""
        if not ctx.group_metas:  # one group: the same for every layer
            meta = ctx.meta
            return [meta.slot_mapping] * len(self.groups), [meta.decode_gather.view(nd, -1)] * len(self.groups)
        metas = ctx.group_metas
        tables = [m.decode_gather.view(nd, -1) for m in metas]
        return [metas[g].slot_mapping for g in self.groups], [tables[g] for g in self.groups]

    def _lora_operands(self, lora: LoraBatch) -> torch.ScriptObject:
        """The step's adapter operands (cpu_decode.cpp LoraSet): per layer, per linear, per segment A,
        B^T, spans and tile-layout copies, checked and laid out once by the C++ side. Kept for the last
        segment order (decode steps of one set of adapters repeat it: 480 look-ups and the checks of
        1,920 tensors a step for 4 adapters otherwise); the kept set holds its segments' pairs, so an
        identity check cannot be fooled by a reused id."""
        key = [seg.layers for seg in lora.segments]
        if self._lora_set is not None and len(self._lora_set[0]) == len(key) and all(
                a is b for a, b in zip(self._lora_set[0], key, strict=True)):  # fmt: skip
            return self._lora_set[1]
        lists: tuple[list[torch.Tensor], ...] = ([], [], [], [])
        for index in range(len(self.layers)):
            layer = lora.layer(index)
            for module in LORA_MODULES:
                ops = layer.pairs_of(module)
                for acc, part in zip(lists, (ops.a, ops.bt, ops.spans, ops.packed), strict=True):
                    acc += part
        lora_set = torch.classes.tokenmill.LoraSet(*lists, len(key))
        self._lora_set = (key, lora_set)
        return lora_set

    def _plan(self, rows: int, fused_act: bool = True) -> _Plan | None:
        """The calls for `rows` rows; fused_act False: never the fused silu product (LoRA steps)."""
        weights: list[torch.Tensor | None] = []
        kinds: list[int] = []
        shapes: list[int] = []
        ggml_types: list[int] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.fused_rotary is False and not self.qk_norm:
                return None  # the in-place rotary kernel is what the C++ loop calls
            linears = [_linear(attn.qkv_proj, rows, False), _linear(attn.o_proj, rows, False),
                       _linear(mlp.gate_up_proj, rows, mlp.fused_act and fused_act),
                       _linear(mlp.down_proj, rows, False)]  # fmt: skip
            if any(lin is None for lin in linears):
                return None
            norms = [layer.input_layernorm, layer.post_attention_layernorm,
                     attn.q_norm if self.qk_norm else None, attn.k_norm if self.qk_norm else None]
            weights += [self._norm_weight(n) for n in norms]
            for lin in linears:
                weights += [lin.weight, lin.scales, lin.bias]
                kinds.append(lin.kind)
                shapes += [lin.n, lin.k]
                ggml_types.append(lin.ggml_type)
            if self.gemma:
                weights += [self._norm_weight(layer.pre_feedforward_layernorm),
                            self._norm_weight(layer.post_feedforward_layernorm)]  # fmt: skip
            else:
                weights += [None, None]
        return _Plan(weights, kinds, shapes, ggml_types)

    def _norm_weight(self, norm: nn.Module | None) -> torch.Tensor | None:
        """A norm's weight as the C++ loop takes it: Gemma's as 1 + weight in float32 (GemmaRMSNorm.forward's
        `1.0 + self.weight.float()`, computed once), anyone else's as it is."""
        if norm is None:
            return None
        if not self.gemma:
            return norm.weight
        w1 = self._norms.get(id(norm.weight))
        if w1 is None:
            w1 = self._norms[id(norm.weight)] = 1.0 + norm.weight.detach().float()
        return w1


def _linear(mod: nn.Module, rows: int, silu: bool) -> _Linear | None:
    """What `mod` runs for `rows` rows (its forward, or silu_mul when `silu`): GEMV_SILU only for a
    silu_mul the kernel computes; otherwise the caller applies silu(gate) * up to the output."""
    if isinstance(mod, Int8Linear):
        if mod.kernel and mod.interleave == silu and rows <= mod.max_rows:
            return _Linear(GEMV_SILU if silu else GEMV, mod.q, mod.scales, mod.bias, mod.out_features, mod.in_features)
        return None  # dequantized for the call: the Python layers
    if isinstance(mod, GemvLinear):  # forward: the kernel (interleaved: its plain product); silu_mul: the kernel
        if rows <= mod.max_rows:
            kind = GEMV_SILU if silu else GEMV_SPLIT if mod.interleave else GEMV
            return _Linear(kind, mod.packed, None, mod.bias, mod.out_features, mod.in_features)
        if mod.large is not None:
            return _plain_or_packed(mod.large)
        return _Linear(PLAIN, mod.weight, None, mod.bias, mod.out_features, mod.in_features)
    if isinstance(mod, GemvF32Linear):  # silu: the C++ loop applies silu(gate) * up to the product
        if rows <= mod.max_rows:
            return _Linear(GEMV_F32, mod.packed, None, mod.bias, mod.out_features, mod.in_features)
        return _Linear(PLAIN, mod.weight, None, mod.bias, mod.out_features, mod.in_features)
    if isinstance(mod, GGMLLinear):  # the blocks' kernel; silu: the C++ loop applies silu(gate) * up
        if rows > mod.max_rows or not isinstance(mod.weight_q, GGMLWeight):
            return None  # dequantized for the call, or shards of several types: the Python layers
        w = mod.weight_q
        return _Linear(GGML_Q8 if mod.activations == "int8" else GGML, w.blocks, None, mod.bias, w.n, w.k, w.type)
    if isinstance(mod, TiledLinear):  # batch-invariant mode: one oneDNN call up to its call_rows only
        if rows <= mod.kernel_rows:  # below that the kernel in oneDNN's order (same bits)
            return _Linear(GEMV_BLOCKED, mod.gemv_packed, None, mod.bias, mod.out_features, mod.in_features)
        return _plain_or_packed(mod.inner) if rows <= mod.call_rows else None
    return _plain_or_packed(mod)


def _plain_or_packed(mod: nn.Module) -> _Linear | None:
    if isinstance(mod, PackedLinear):
        return _Linear(ONEDNN, mod.packed, None, mod.bias, mod.out_features, mod.in_features)
    if isinstance(mod, nn.Linear):
        return _Linear(PLAIN, mod.weight, None, mod.bias, mod.out_features, mod.in_features)
    return None
