"""Start-up choice of the linear layers on the CPU (EngineConfig.pack_weights, cpu_gemv, quantization).

- bf16: every linear gets the C++ small-batch kernel (GemvLinear) for the row counts where it
  measures faster than oneDNN's packed product on this machine (`cpu_gemv="auto"`, timed per weight
  shape here, a few hundred ms for a 135M model), oneDNN above them; a shape where the kernel never
  wins stays a plain PackedLinear. `cpu_gemv="on"`: the kernel at every row count (tests); "off",
  no compiler, or a CPU without AVX2/FMA (one log line says which): oneDNN only. The kernel's path
  (AMX, AVX-512 BF16, AVX2) is the CPU's (engine/kernels/csrc/isa.h); oneDNN does not pack bf16 on an
  AVX2-only CPU, so F.linear stands above the kernel's rows there.
- INT8 (`quantization="int8"`, any dtype): every linear and the logits head quantized per output
  channel, the embedding looked up in INT8 (a tied model's in the head's own weight; a mixture-of-experts
  model's experts each quantized as a linear, its routers left in dtype, engine/models/moe.py); the kernel
  for the row counts where it beats dequantizing the weight for PyTorch, the latter above. Without
  the kernels (same conditions, one log line) the weights stay INT8 and are dequantized per call.
- float32 on a CPU with AVX2/FMA: the float32 small-batch kernel (GemvF32Linear) up to f32_max_rows()
  rows (a fixed limit, not timed: 12 where MKL has AVX-512, else 32; "on": every row count), MKL's
  F.linear above; "off" or no kernel: F.linear only.
- GGUF blocks (`quantization="gguf"`): the matrices engine/weights/gguf/blocks.py kept as the file stores
  them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) become GGMLLinear (engine/models/gguf_linear.py):
  the block kernel, with EngineConfig.gguf_activations (int8 by default, or float), for the row counts
  where it beats dequantizing the weight for PyTorch (measured per shape, as above), the latter above; the embedding is looked up in its blocks (a tied model's in the head's). The file's other
  matrices (dequantized into dtype at load) take the bf16 path above, or F.linear.
- CUDA: nothing changes here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import EngineConfig
from engine.config.engine_config import resolve_step_budget
from engine.kernels import cpu_kernels
from engine.models.batch_invariant import row_linears
from engine.models.cpu_linear import (
    ALWAYS,
    GemvF32Linear,
    GemvLinear,
    Int8Embedding,
    Int8Linear,
    kernels_unavailable,
    measure_max_rows,
    silu_mul,
)
from engine.models.gguf_linear import GGMLEmbedding, GGMLLinear, GGMLStack, GGMLWeight
from engine.models.invariant_linear import (
    CALL_ROWS,
    RowLinear,
    TiledLinear,
    cancelling_inputs,
    kernel_agrees,
    rows_agree,
)
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MoeCausalLM
from engine.models.packed_linear import PackedLinear, packing_supported
from engine.models.quantization import Int8Weight, group_for, quantize_int8

log = logging.getLogger("tokenmill.engine")

# Rows up to which float32 linears take the AVX2 kernel (cpu_gemv "auto"), by the vector width MKL's
# own products use here. Measured over SmolLM2-135M's linears with cold weights (docs/ENGINE.md): on an
# AVX2-only 2-vCPU AMD EPYC (Zen 3) the kernel is 2.8x MKL at 1-8 rows, 1.2-1.8x at 16-32, even at 64;
# on a 2-vCPU Xeon with AVX-512 it is 1.0-1.3x at 1-12 rows and 0.9x at 16, 0.7x at 32.
F32_MAX_ROWS = {"AVX512": 12}
F32_MAX_ROWS_DEFAULT = 32


def f32_max_rows() -> int:
    """The float32 kernel's row limit on this CPU: fixed per machine, so every engine of a process (a
    version swap, speculation on and off) computes the same bits for a row."""
    return F32_MAX_ROWS.get(torch.backends.cpu.get_cpu_capability(), F32_MAX_ROWS_DEFAULT)


@dataclass(frozen=True)
class WeightsReport:
    """What prepare_weights did, for the engine's start-up log line and the benchmarks."""

    packed: bool  # oneDNN-packed bf16 layouts in use
    quantization: str | None  # "int8", "gguf (Q4_1, Q8_0)" (the types kept; "; dequantized: ..."), or None
    gemv: str  # the small-batch kernels: "off (why)", or "<rows> x <cols>: up to R rows" per weight shape
    weight_bytes: int  # bytes of the linear weights (logits head included) one decode step reads


def prepare_weights(model: LlamaForCausalLM, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                    preloaded: Mapping[str, Int8Weight] | None = None,
                    ggml: Mapping[str, GGMLWeight | GGMLStack] | None = None, ggml_text: str = "gguf") -> WeightsReport:
    """Replace the model's linears (in place) as the module docstring says; returns what it did.

    preloaded: INT8 weights that arrived quantized (a GGUF Q8_0 tensor through
    quantization.int8_from_blocks; a fused weight's shards concatenated by rows, as its scales are
    per row), by the name of the model parameter they stand for ("model.layers.0.self_attn.qkv_proj.weight",
    "model.embed_tokens.weight"). With quantization "int8" they are used as they are and the rest
    is quantized here; without it they are refused.

    ggml: GGUF blocks by parameter name (engine/weights/gguf/blocks.py; their parameters were never
    written), kept as they are; ggml_text: the report's quantization field then."""
    if ggml:
        if config.deterministic:
            raise ValueError("deterministic does not take GGUF quantized weights: use quantization='none' "
                             "(the weights dequantized to dtype)")
        if device.type != "cpu":
            return _ggml_triton(model, device, dtype, dict(ggml), ggml_text)
        return _ggml(model, config, dtype, dict(ggml), ggml_text)
    if config.quantization in ("int8",) and device.type != "cpu":
        raise ValueError(f"quantization {config.quantization!r} runs on the CPU only (device is {device})")
    if preloaded and config.quantization != "int8":
        raise ValueError("preloaded INT8 weights need quantization='int8'")
    if config.deterministic:
        return _invariant(model, config, device, dtype, dict(preloaded or {}))
    if config.quantization == "int8":
        return _int8(model, config, dtype, dict(preloaded or {}))
    if device.type == "cpu" and dtype == torch.float32:
        return _f32(model, config)
    if device.type != "cpu" or dtype != torch.bfloat16:
        return WeightsReport(False, None, "off (bf16 on the CPU only)", _weight_bytes(model))
    return _bf16(model, config, config.pack_weights and packing_supported(device, dtype))


def _invariant(model: LlamaForCausalLM, config: EngineConfig, device: torch.device, dtype: torch.dtype,
               preloaded: dict[str, Int8Weight]) -> WeightsReport:
    """Batch-invariant linears (engine/models/batch_invariant.py): the C++ kernels at every row count for bf16
    and INT8 weights (no oneDNN copy), one-row products for float32; ValueError where they cannot run."""
    if device.type != "cpu":
        raise ValueError(f"deterministic runs on the CPU only (device is {device})")
    if isinstance(model, MoeCausalLM):
        _invariant_routers(model, config)
    if config.quantization != "int8" and dtype == torch.float32:
        reason = "cpu_gemv is 'off'" if config.cpu_gemv == "off" else kernels_unavailable("f32")
        if reason is None:  # one float32 chain per output in column order, whatever the rows: invariant
            model.replace_linears(lambda weight, bias, role: GemvF32Linear(weight, bias, ALWAYS))
            return WeightsReport(False, None, "deterministic (float32 kernel, all rows)", _weight_bytes(model))
        row_linears(model)
        return WeightsReport(False, None, f"off (float32: one-row products, deterministic; {reason})",
                             _weight_bytes(model))
    if config.quantization != "int8" and dtype != torch.bfloat16:
        raise ValueError(f"deterministic supports float32 and bfloat16 on the CPU, not {dtype}")
    kind = "int8" if config.quantization == "int8" else "bf16"
    reason = kernels_unavailable(kind)
    if kind == "bf16" and packing_supported(device, dtype):
        return _tiled(model, config, reason)
    if reason is not None:
        raise ValueError(f"deterministic needs the C++ {kind} linear kernels: {reason}")
    forced = dataclasses.replace(config, cpu_gemv="on")  # every row count on the kernel
    if kind == "int8":
        return _int8(model, forced, dtype, preloaded)
    return _bf16(model, forced, onednn=False)


def _invariant_routers(model: MoeCausalLM, config: EngineConfig) -> None:
    """An MoE model's routers in the mode: their float32 logits from the float32 kernel at every row count
    (one chain per output in column order, whatever the rows), else one-row products. The experts are
    linears like the others (replace_linears); the routing and the sum back are per row already."""
    reason = "cpu_gemv is 'off'" if config.cpu_gemv == "off" else kernels_unavailable("f32")
    for block in model.moe_blocks():
        weight = block.gate.weight.detach().float()
        block.gate.invariant = GemvF32Linear(weight, None, ALWAYS) if reason is None else RowLinear(weight, None)


def _tiled(model: LlamaForCausalLM, config: EngineConfig, gemv_reason: str | None) -> WeightsReport:
    """bf16 in the mode: oneDNN in calls of at most CALL_ROWS rows where the start-up check finds rows
    unchanged by the batch for the weight's shape (and below them the C++ kernel that sums in oneDNN's
    order, where its bits are oneDNN's: small_rows), else that kernel at every row count
    (_kernel_everywhere)."""
    agree: dict[tuple, bool] = {}
    small: dict[tuple, int] = {}
    everywhere: dict[tuple, bool] = {}  # _kernel_keeps_rows per shape where agree is False

    def make(weight: torch.Tensor, bias: torch.Tensor | None, role: str) -> nn.Module:
        lin = TiledLinear(weight, bias)
        key = _key(weight, bias, False)
        if key not in agree:
            agree[key] = rows_agree(lin, lin.in_features, torch.bfloat16)
        if agree[key]:
            if key not in small:  # checked and timed on this layer's weight: it keeps the packed copy
                small[key] = _small_rows(lin, weight, config, gemv_reason)
            lin.kernel_rows = small[key]
            if lin.kernel_rows and lin.gemv_packed is None:
                lin.use_kernel(weight)
            elif not lin.kernel_rows:
                lin.gemv_packed = None  # the kernel's copy only where it is used
            return lin
        if gemv_reason is not None:
            raise ValueError(f"deterministic: oneDNN's rows change with the batch for a {tuple(weight.shape)} "
                             f"weight and the C++ linear kernels cannot replace it: {gemv_reason}")
        if key not in everywhere:
            everywhere[key] = _kernel_keeps_rows(weight.shape)
        if not everywhere[key]:
            raise ValueError(f"deterministic: neither oneDNN nor the C++ kernel keeps a {tuple(weight.shape)} "
                             "weight's rows independent of the batch on this CPU")  # fmt: skip
        return _kernel_everywhere(weight, bias)

    model.replace_linears(make)

    def describe(key: tuple, ok: bool) -> str:
        n, k = key[0], key[1]
        if not ok:
            return f"{n}x{k}: kernel, all rows"
        rows = small.get(key, 0)
        return f"{n}x{k}: oneDNN, <= 32 rows a call" + (f", its order in the kernel <= {rows} rows" if rows else "")

    plan = "; ".join(describe(key, ok) for key, ok in agree.items())
    return WeightsReport(True, None, f"deterministic ({plan})", _weight_bytes(model))


def _kernel_everywhere(weight: torch.Tensor, bias: torch.Tensor | None) -> TiledLinear:
    """The mode's linear for a shape where oneDNN's rows change with the batch: gemv_blocked at every row
    count, one summation order whatever the rows (the tile unit's up to 32 rows on an AMX CPU, the
    AVX-512 tiles' emulation of that order beyond), where _kernel_keeps_rows passed for the shape."""
    lin = TiledLinear(weight, bias)
    lin.use_kernel(weight)
    lin.kernel_rows = 1 << 62
    return lin


def _kernel_keeps_rows(shape: torch.Size) -> bool:
    """The start-up check of _kernel_everywhere for a weight shape, on cancelling inputs: a row alone
    and inside calls of 5 and 40 rows must have the same bits."""
    n, k = shape
    x, w = cancelling_inputs(40, k, n, seed=2)
    probe = _kernel_everywhere(w, None)
    with torch.inference_mode():
        alone = torch.cat([probe(x[i : i + 1]) for i in range(40)])
        return all(torch.equal(probe(x[:m]), alone[:m]) for m in (5, 40))


def _small_rows(lin: TiledLinear, weight: torch.Tensor, config: EngineConfig, gemv_reason: str | None) -> int:
    """Rows up to which the mode runs `lin` on gemv_blocked: 0 without the kernels, with cpu_gemv "off",
    or where its bits are not oneDNN's for this shape; else all CALL_ROWS ("on") or timed ("auto"). The
    timing cannot change a result: below and above the limit every row has the same bits."""
    if gemv_reason is not None or config.cpu_gemv == "off":
        return 0
    if not kernel_agrees(lin, weight):  # (leaves lin with the kernel's copy of weight)
        log.info("deterministic: the kernel's sums are not oneDNN's for a %s weight; oneDNN at every row count",
                 tuple(weight.shape))
        return 0
    if config.cpu_gemv == "on":
        return CALL_ROWS
    with torch.inference_mode():
        return measure_max_rows(lin.kernel, lin.inner, lin.in_features, torch.bfloat16, CALL_ROWS)


def _bf16(model: LlamaForCausalLM, config: EngineConfig, onednn: bool) -> WeightsReport:
    reason = "cpu_gemv is 'off'" if config.cpu_gemv == "off" else kernels_unavailable("bf16")
    if reason is not None:
        if config.cpu_gemv != "off":
            log.warning("small-batch linear kernels unavailable (%s); using %s", reason,
                        "oneDNN's packed linears" if onednn else "F.linear")
        if onednn:
            model.pack_weights(batch_hint=config.max_num_seqs)
        return WeightsReport(onednn, None, f"off ({reason})", _weight_bytes(model))
    plans: dict[tuple, int] = {}

    def make(weight: torch.Tensor, bias: torch.Tensor | None, role: str) -> nn.Module:
        if plans.get(_key(weight, bias, role == "gate_up")) == 0:  # measured on an earlier layer: never faster
            return PackedLinear(weight, bias, config.max_num_seqs) if onednn else _plain(weight, bias)
        lin = GemvLinear(weight, bias, ALWAYS, config.max_num_seqs, role == "gate_up", onednn)
        lin.max_rows = _planned_rows(plans, lin, role, config, torch.bfloat16)
        if lin.max_rows:
            return lin
        # The kernel never wins on this shape: one layout only.
        return lin.large if onednn else _plain(weight, bias)

    model.replace_linears(make)
    return WeightsReport(onednn, None, _plan_text(plans), _weight_bytes(model))


def _f32(model: LlamaForCausalLM, config: EngineConfig) -> WeightsReport:
    reason = "cpu_gemv is 'off'" if config.cpu_gemv == "off" else kernels_unavailable("f32")
    if reason is not None:
        if config.cpu_gemv != "off":
            log.warning("float32 small-batch linear kernel unavailable (%s); using F.linear", reason)
        return WeightsReport(False, None, f"off ({reason})", _weight_bytes(model))
    # A fixed limit, not timed at start-up: two engines of one process (speculation on and off, a
    # version swap) then compute the same bits, and a timing with the weight in cache would favour
    # MKL, which re-reads the weight per call (docs/ENGINE.md, "float32 small-batch kernel").
    max_rows = ALWAYS if config.cpu_gemv == "on" else f32_max_rows()
    model.replace_linears(lambda weight, bias, role: GemvF32Linear(weight, bias, max_rows))
    limit = "all" if max_rows == ALWAYS else str(max_rows)
    return WeightsReport(False, None, f"float32 kernel: <= {limit} rows, F.linear above", _weight_bytes(model))


def _int8(model: LlamaForCausalLM, config: EngineConfig, dtype: torch.dtype,
          preloaded: dict[str, Int8Weight]) -> WeightsReport:
    reason = "cpu_gemv is 'off'" if config.cpu_gemv == "off" else kernels_unavailable("int8")
    if reason is not None and config.cpu_gemv != "off":
        log.warning("INT8 kernels unavailable (%s); INT8 weights are dequantized for each product", reason)
    plans: dict[tuple, int] = {}
    tied = model.lm_head is None
    int8_of = _int8_source(model, preloaded, config.quantization_group_size)

    def make(weight: torch.Tensor, bias: torch.Tensor | None, role: str) -> nn.Module:
        lin = Int8Linear(int8_of(weight), bias, ALWAYS, reason is None, role == "gate_up")
        if reason is None:
            lin.max_rows = _planned_rows(plans, lin, role, config, dtype)
        return lin

    model.replace_linears(make)
    embed = model.model.embed_tokens
    # Tied: the embedding's rows are the head's; untied: its own INT8 rows, looked up only (plain layout).
    source = model.lm_head if tied else Int8Linear(int8_of(embed.weight), None, 0, kernel=False)
    model.model.embed_tokens = Int8Embedding(source, dtype)
    gemv = f"off ({reason})" if reason is not None else _plan_text(plans)
    text = "int8"
    if isinstance(model, MoeCausalLM):  # every expert's matrices too; the routers stay float (float32 logits)
        text = f"int8 (experts included; routers in {str(dtype).removeprefix('torch.')})"
    return WeightsReport(False, text, gemv, _weight_bytes(model))


def _ggml(model: LlamaForCausalLM, config: EngineConfig, dtype: torch.dtype, blocks: dict[str, GGMLWeight | GGMLStack],
          text: str) -> WeightsReport:
    reason = "cpu_gemv is 'off'" if config.cpu_gemv == "off" else cpu_kernels.load("ggml")
    if reason is not None and config.cpu_gemv != "off":
        log.warning("GGUF block kernels unavailable (%s); the blocks are dequantized for each product", reason)
    bf16_reason = kernels_unavailable("bf16") if dtype == torch.bfloat16 and config.cpu_gemv != "off" else "off"
    name_of = _ParamNames(model)
    unknown = sorted(set(blocks) - set(name_of.names))
    if unknown:
        raise ValueError(f"GGUF blocks for parameters the model does not have: {unknown[:5]}")
    plans: dict[tuple, int] = {}
    tied = model.lm_head is None

    def make(weight: torch.Tensor, bias: torch.Tensor | None, role: str) -> nn.Module:
        given = blocks.get(name_of(weight) or "")
        if given is None:  # dequantized at load: the bf16 kernel where it runs, else F.linear
            if bf16_reason is not None:
                return _plain(weight, bias)
            lin = GemvLinear(weight, bias, ALWAYS, config.max_num_seqs, role == "gate_up", onednn=False)
            lin.max_rows = _planned_rows(plans, lin, role, config, dtype)
            return lin if lin.max_rows else _plain(weight, bias)
        if (given.n, given.k) != tuple(weight.shape):
            raise ValueError(f"GGUF blocks {name_of(weight)!r} are {given.n}x{given.k}, the model's "
                             f"{tuple(weight.shape)}")
        qlin = GGMLLinear(given, bias, ALWAYS, reason is None, role == "gate_up",
                          _activations(config.gguf_activations, name_of(weight) or ""))
        if reason is None:
            qlin.max_rows = _planned_rows(plans, qlin, role, config, dtype)
        return qlin

    model.replace_linears(make)
    embed = model.model.embed_tokens
    embed_blocks = blocks.get("model.embed_tokens.weight")
    if embed_blocks is not None:  # looked up in its blocks: the head's (tied) or its own
        source = model.lm_head if tied else GGMLLinear(embed_blocks, None, 0, kernel=False)
        model.model.embed_tokens = GGMLEmbedding(source, dtype)
    elif not tied and not isinstance(embed, nn.Embedding):
        raise ValueError("the embedding is neither blocks nor a plain embedding")
    gemv = f"off ({reason})" if reason is not None else _plan_text(plans)
    if reason is None:  # the kernels' activations (engine/models/gguf_linear.py)
        text += f"; {config.gguf_activations} activations"
        if config.gguf_activations == "mixed":
            text += " (int8, float for the MLP down projection)"
    return WeightsReport(False, text, gemv, _weight_bytes(model))


def _activations(mode: str, name: str) -> str:
    """A block linear's activations under EngineConfig.gguf_activations: "mixed" keeps float32 for an MLP's
    down projection (its input, silu(gate) * up, has outliers that a 32-value int8 unit scaled to its
    largest value rounds the rest of to few levels: the real SmolLM2 Q4_1 model's perplexity moved +0.57%
    with int8 there, +0.11% with float, docs/ENGINE.md) and int8 for the rest."""
    if mode == "mixed":
        return "float" if name.endswith("down_proj.weight") else "int8"
    return mode


def _ggml_triton(model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype,
                 blocks: dict[str, GGMLWeight | GGMLStack], text: str) -> WeightsReport:
    """GGUF blocks on CUDA (or CPU tensors under the Triton interpreter): TritonGGMLLinear modules
    (engine/models/gguf_triton_linear.py), the blocks moved to `device`; the rest stays as loaded."""
    from engine.models.gguf_triton_linear import DEFAULT_MAX_ROWS, TritonGGMLLinear, to_device

    name_of = _ParamNames(model)
    unknown = sorted(set(blocks) - set(name_of.names))
    if unknown:
        raise ValueError(f"GGUF blocks for parameters the model does not have: {unknown[:5]}")
    tied = model.lm_head is None

    def make(weight: torch.Tensor, bias: torch.Tensor | None, role: str) -> nn.Module:
        given = blocks.get(name_of(weight) or "")
        if given is None:
            return _plain(weight, bias)
        if (given.n, given.k) != tuple(weight.shape):
            raise ValueError(f"GGUF blocks {name_of(weight)!r} are {given.n}x{given.k}, the model's "
                             f"{tuple(weight.shape)}")
        return TritonGGMLLinear(to_device(given, device), bias, DEFAULT_MAX_ROWS, role == "gate_up")

    model.replace_linears(make)
    embed = model.model.embed_tokens
    embed_blocks = blocks.get("model.embed_tokens.weight")
    if embed_blocks is not None:  # looked up in its blocks: the head's (tied) or its own
        source = model.lm_head if tied else TritonGGMLLinear(to_device(embed_blocks, device), None, 0)
        model.model.embed_tokens = GGMLEmbedding(source, dtype)
    elif not tied and not isinstance(embed, nn.Embedding):
        raise ValueError("the embedding is neither blocks nor a plain embedding")
    gemv = f"triton (GEMV up to {DEFAULT_MAX_ROWS} rows, then dequantize + matmul)"
    return WeightsReport(False, f"{text}; Triton", gemv, _weight_bytes(model))


class _ParamNames:
    """A weight's parameter name, from the model before any replacement; None for another tensor (an
    expert's row of a stack, engine/models/moe.py). Holds the parameters, so no id is reused while a
    replacement frees the modules it replaced."""

    def __init__(self, model: nn.Module) -> None:
        self.params = dict(model.named_parameters())
        self.names = list(self.params)
        self._by_id = {id(p): name for name, p in self.params.items()}

    def __call__(self, weight: torch.Tensor) -> str | None:
        name = self._by_id.get(id(weight))
        return name if name is not None and self.params[name] is weight else None


def _int8_source(model: nn.Module, preloaded: dict[str, Int8Weight],
                 group_size: int | None) -> Callable[[torch.Tensor], Int8Weight]:
    """weight -> its INT8 form: the preloaded one for its parameter name, else quantized here."""
    name_of = _ParamNames(model)
    unknown = sorted(set(preloaded) - set(name_of.names))
    if unknown:
        raise ValueError(f"preloaded INT8 weights for parameters the model does not have: {unknown[:5]}")

    def int8_of(weight: torch.Tensor) -> Int8Weight:
        name = name_of(weight)
        given = preloaded.get(name) if name else None
        if given is None:
            return quantize_int8(weight, group_for(weight.shape[1], group_size))
        if given.q.shape != weight.shape:
            raise ValueError(f"preloaded INT8 weight {name!r} is {tuple(given.q.shape)}, the model's {tuple(weight.shape)}")
        return given

    return int8_of


def _planned_rows(plans: dict[tuple, int], lin: GemvLinear | Int8Linear | GGMLLinear, role: str, config: EngineConfig,
                  dtype: torch.dtype) -> int:
    """lin's max_rows: ALWAYS with cpu_gemv "on" and for a GGUF-block head, else measured once per weight shape (in `plans`)
    over the row counts it meets: up to max_num_seqs for the logits head (sampled rows only), up to
    the step's token budget for the others (prefill chunks)."""
    kind = lin.weight_q.type_name if isinstance(lin, GGMLLinear) else ""
    key = (lin.out_features, lin.in_features, lin.bias is not None, lin.interleave, kind)  # = _key(...) for bf16
    if key not in plans:
        budget = resolve_step_budget(config.max_num_batched_tokens, torch.device("cpu"))  # CPU weights
        limit = config.max_num_seqs if role == "lm_head" else max(config.max_num_seqs, budget)
        if config.cpu_gemv == "on" or (role == "lm_head" and isinstance(lin, GGMLLinear)):
            # a block head's other path dequantizes the whole vocabulary's matrix for each step's few
            # sampled rows (Gemma 3's 262144 x 640: seconds a trial, minutes of start-up to measure)
            plans[key] = ALWAYS
        else:
            plans[key] = _measure(lin, limit, dtype)
    return plans[key]


def _key(weight: torch.Tensor, bias: torch.Tensor | None, interleave: bool) -> tuple:
    return (weight.shape[0], weight.shape[1], bias is not None, interleave, "")


def _measure(lin: GemvLinear | Int8Linear | GGMLLinear, limit: int, dtype: torch.dtype) -> int:
    """Rows up to which lin's kernel beats its other path (oneDNN, or dequantize + F.linear)."""
    product = lin._large if isinstance(lin, GemvLinear) else lin._dequantized_linear
    other = (lambda x: silu_mul(product(x))) if lin.interleave else product
    kernel = lin.silu_mul if lin.interleave else lin  # lin.max_rows is ALWAYS while it is measured
    with torch.inference_mode():
        return measure_max_rows(kernel, other, lin.in_features, dtype, limit)


def _plain(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return lin


def _plan_text(plans: dict[tuple, int]) -> str:
    parts = []
    for (n, k, _, interleave, kind), rows in plans.items():
        limit = "all" if rows == ALWAYS else str(rows)
        parts.append(f"{n}x{k}{f' {kind}' if kind else ''}{' (silu)' if interleave else ''}: <= {limit} rows")
    return "; ".join(parts) or "no linears"


def _weight_bytes(model: nn.Module) -> int:
    """Bytes of the linear weights (the logits head included) a one-token decode step reads; a
    mixture-of-experts layer's experts count top_k / num_experts of their bytes (the token's experts)."""
    total = 0.0
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    # An untied INT8 embedding's rows are looked up, not multiplied: not read whole.
    lookup_only = (embed.source if isinstance(embed, (Int8Embedding, GGMLEmbedding)) and embed.source is not model.lm_head
                   else None)
    inner = {id(m.large) for m in model.modules() if isinstance(m, GemvLinear)}  # counted with their GemvLinear
    inner |= {id(m.inner) for m in model.modules() if isinstance(m, TiledLinear)}
    share: dict[int, float] = {}  # module id -> the share of it one token reads (MoE experts)
    for block in model.moe_blocks() if isinstance(model, MoeCausalLM) else []:
        ex, part = block.experts, block.top_k / block.experts.num_experts
        share.update((id(sub), part) for m in [*(ex.gate_up or []), *(ex.down or [])] for sub in m.modules())
        if ex.gate_up is None:  # still stacked (no kernels): F.linear over the stacks
            total += part * sum(p.numel() * p.element_size() for p in (ex.gate_up_proj, ex.down_proj))
    for m in model.modules():
        if m is lookup_only or id(m) in inner:
            continue
        part = share.get(id(m), 1.0)
        if isinstance(m, (GemvLinear, GemvF32Linear, Int8Linear, GGMLLinear)) \
                or isinstance(getattr(m, "weight_q", None), (GGMLWeight, GGMLStack)):  # fmt: skip  # TritonGGMLLinear
            total += part * m.weight_bytes
        elif isinstance(m, (PackedLinear, TiledLinear)):
            total += part * m.out_features * m.in_features * 2
        elif isinstance(m, (nn.Linear, RowLinear)):
            total += part * m.weight.numel() * m.weight.element_size()
    if getattr(model, "lm_head", True) is None:  # tied and unreplaced: the logits read the embedding
        total += embed.weight.numel() * embed.weight.element_size()
    return round(total)
