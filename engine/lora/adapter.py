"""Read a PEFT LoRA folder into per-layer fused A/B matrices, validating everything before anything
is kept (a refused adapter leaves nothing behind).

A PEFT folder: adapter_config.json (r, lora_alpha, use_rslora, target_modules, ...) and
adapter_model.safetensors with `...layers.{i}.{self_attn|mlp}.{q_proj|...}.lora_{A|B}.weight`,
A: [r, in_features], B: [out_features, r]. The delta PEFT adds is scale * x A^T B^T with
scale = alpha / r (alpha / sqrt(r) with rsLoRA); dropout is a training-time op and is ignored.

Our layers fuse q/k/v and gate/up (engine/lora/shapes.py), so an adapter's shards are fused too:
A_fused = [A_q; A_k; A_v] ([r_q + r_k + r_v, in]) and B_fused block-diagonal ([q + k + v, r_q + r_k + r_v],
each shard's B, scale folded in, at its row and rank offset; zeros elsewhere). Then
x A_fused^T B_fused^T is every shard's delta side by side, in one pair of products.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.api.errors import (
    LoraBadConfig,
    LoraBaseMismatch,
    LoraFilesMissing,
    LoraRankTooHigh,
    LoraShapeError,
    LoraUnsupportedTarget,
)
from engine.lora.shapes import ATTENTION, FUSED, MLP, TARGETS, BaseShapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$")
FIELD = "lora_path"

class Pair(tuple):
    """One fused module's pair, unpacked as the 2-tuple (A [R, in], B [out, R]) (scale folded into B;
    placed on a device: (A, B^T [R, out])), with `spans`: int64 [S, 4], a row (c0, c1, r0, r1) per
    shard: output features [c0, c1) take ranks [r0, r1), B being zero elsewhere (block-diagonal);
    tokenmill::lora_add_ reads and multiplies only the spans (engine/kernels/csrc/cpu_lora.cpp). `packed`: the
    pair in the tile layouts of lora_add_'s AMX path (bf16 on a CPU with AMX, made once when placed),
    else None."""

    spans: torch.Tensor
    packed: torch.Tensor | None

    def __new__(cls, a: torch.Tensor, b: torch.Tensor, spans: torch.Tensor, packed: torch.Tensor | None = None) -> Pair:
        pair = super().__new__(cls, (a, b))
        pair.spans = spans
        pair.packed = packed
        return pair


@dataclass
class LoraAdapter:
    """A validated adapter, its matrices fused per layer. `layers[i]` maps a fused module name (qkv, o,
    gate_up, down) to its pair; a module the adapter does not target is absent."""

    name: str
    path: str
    rank: int  # the largest module rank
    targets: tuple[str, ...]  # PEFT module names it adapts
    base_model: str | None  # base_model_name_or_path from its config (informational)
    layers: list[dict[str, Pair]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for layer in self.layers for a, b in layer.values())  # fmt: skip

    def to(self, device: torch.device, dtype: torch.dtype) -> list[dict[str, Pair]]:
        """The pairs as a step uses them, on `device` in `dtype`: (A [R, in], B^T [R, out]), both
        contiguous (B transposed once here, so the delta adds whole rows of B^T: engine/lora/batch.py)."""
        return [{m: _placed(p, device, dtype) for m, p in layer.items()} for layer in self.layers]


def _placed(pair: Pair, device: torch.device, dtype: torch.dtype) -> Pair:
    """(A, B^T) on `device` in `dtype`, and on a CPU whose bf16 deltas run on the tile unit, the pair in
    its tile layouts too (a vector about A's and the spans' size: placed adapters take ~2x the memory)."""
    from engine.lora.batch import tile_unit

    a, bt = pair[0].to(device, dtype).contiguous(), pair[1].to(device, dtype).t().contiguous()
    packed = None
    if device.type == "cpu" and dtype == torch.bfloat16 and a.shape[1] % 32 == 0 and tile_unit():
        packed = torch.ops.tokenmill.lora_pack_bf16(a, bt, pair.spans)
    return Pair(a, bt, pair.spans, packed)


def read_adapter(name: str, path: str, shapes: BaseShapes, max_rank: int) -> LoraAdapter:
    """Read and validate the PEFT folder at `path`. Raises a LoraError naming the problem."""
    folder = Path(path)
    cfg = _read_config(folder)
    tensors = _read_tensors(folder)
    _check_moe_targets(cfg, shapes)
    found = _group(tensors, shapes)
    _check_targets(cfg, found)
    layers: list[dict[str, Pair]] = [{} for _ in range(shapes.num_layers)]
    ranks: list[int] = []
    for layer, mods in sorted(found.items()):
        for fused in FUSED:
            shards = {m: ab for m, ab in mods.items() if TARGETS[m][0] == fused}
            if shards:
                pair, shard_ranks = _fuse(layer, fused, shards, cfg, shapes, max_rank)
                layers[layer][fused] = pair
                ranks += shard_ranks
    base = cfg.get("base_model_name_or_path")
    return LoraAdapter(name, str(path), max(ranks), tuple(sorted({m for mods in found.values() for m in mods})),
                       base if isinstance(base, str) else None, layers)  # fmt: skip


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise LoraFilesMissing(FIELD, f"adapter path {str(folder)!r} is not a folder")
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / f).is_file():
            raise LoraFilesMissing(FIELD, f"adapter folder {str(folder)!r} has no {f}")
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise LoraBadConfig(FIELD, f"{CONFIG_FILE} is not readable JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoraBadConfig(FIELD, f"{CONFIG_FILE} must hold a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraBadConfig(FIELD, f"{CONFIG_FILE}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise LoraBadConfig(FIELD, f"{CONFIG_FILE}: use_dora (DoRA adapters) is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraBadConfig(FIELD, f"{CONFIG_FILE}: bias {cfg.get('bias')!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise LoraUnsupportedTarget(FIELD, f"{CONFIG_FILE}: modules_to_save {cfg['modules_to_save']!r} is not "
                                    "supported (only q/k/v/o/gate/up/down projections are adapted)")  # fmt: skip
    if cfg.get("fan_in_fan_out"):
        raise LoraBadConfig(FIELD, f"{CONFIG_FILE}: fan_in_fan_out is not supported (Conv1D bases only)")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoraBadConfig(FIELD, f"{CONFIG_FILE}: {key} must be a positive number, got {value!r}")
    return cfg


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(folder / WEIGHTS_FILE), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoraShapeError(FIELD, f"{WEIGHTS_FILE} is not a readable safetensors file: {exc}") from None


def _group(tensors: dict[str, torch.Tensor], shapes: BaseShapes) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """layer -> PEFT module -> {"A": tensor, "B": tensor}; refuses keys that are not LoRA projections."""
    found: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if shapes.moe and (".experts." in key or (m is not None and m.group(2) in MLP)):
            raise LoraUnsupportedTarget(FIELD, f"{WEIGHTS_FILE}: tensor {key!r}: LoRA on the MLP of a mixture-of-experts "
                                        f"model (its experts) is not supported; target_modules may name "
                                        f"{', '.join(ATTENTION)}")  # fmt: skip
        if m is None:
            raise LoraUnsupportedTarget(FIELD, f"{WEIGHTS_FILE}: tensor {key!r} is not a LoRA A/B matrix of a "
                                        f"decoder projection ({', '.join(TARGETS)})")  # fmt: skip
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGETS:
            raise LoraUnsupportedTarget(FIELD, f"target module {module!r} is not supported; supported: "
                                        f"{', '.join(TARGETS)}")  # fmt: skip
        if module not in shapes.projections:
            raise LoraBaseMismatch(FIELD, f"target module {module!r} is not a projection of the base model (its: "
                                   f"{', '.join(shapes.projections)})")  # fmt: skip
        if layer >= shapes.num_layers:
            raise LoraBaseMismatch(FIELD, f"adapter has layer {layer}; the base model has {shapes.num_layers} layers")
        if t.dim() != 2 or not t.is_floating_point():
            raise LoraShapeError(FIELD, f"{key}: expected a 2-D float matrix, got shape {list(t.shape)} {t.dtype}")
        found.setdefault(layer, {}).setdefault(module, {})[half] = t
    if not found:
        raise LoraShapeError(FIELD, f"{WEIGHTS_FILE} holds no LoRA matrices")
    return found


def _check_moe_targets(cfg: dict, shapes: BaseShapes) -> None:
    """A mixture-of-experts base takes adapters on attention only: target_modules naming an MLP
    projection (or "all-linear", which includes them) is refused with the option's name."""
    targets = cfg.get("target_modules")
    if not shapes.moe or targets is None:
        return
    named = [targets] if isinstance(targets, str) else list(targets)
    bad = [t for t in named if t in MLP or t == "all-linear" or (isinstance(t, str) and "expert" in t)]
    if bad:
        raise LoraUnsupportedTarget(FIELD, f"{CONFIG_FILE}: target_modules {bad}: LoRA on the MLP of a "
                                    f"mixture-of-experts model (its experts) is not supported; target_modules "
                                    f"may name {', '.join(ATTENTION)}")  # fmt: skip


def _check_targets(cfg: dict, found: dict[int, dict[str, dict[str, torch.Tensor]]]) -> None:
    targets = cfg.get("target_modules")
    if isinstance(targets, list):  # a string is a regex (or "all-linear"): the tensors say what it matched
        bad = [t for t in targets if t not in TARGETS]
        if bad:
            raise LoraUnsupportedTarget(FIELD, f"target_modules {bad} not supported; supported: {', '.join(TARGETS)}")
    for layer, mods in found.items():
        for module, halves in mods.items():
            if set(halves) != {"A", "B"}:
                missing = ({"A", "B"} - set(halves)).pop()
                raise LoraShapeError(FIELD, f"layer {layer} {module}: lora_{missing} is missing")


def _scale(cfg: dict, layer: int, module: str, rank: int) -> float:
    alpha = float(cfg["lora_alpha"])
    full = f"model.layers.{layer}.{'mlp' if TARGETS[module][0] in ('gate_up', 'down') else 'self_attn'}.{module}"
    for pattern, value in (cfg.get("alpha_pattern") or {}).items():  # PEFT: a pattern matching the name's tail
        if re.match(rf"(.*\.)?({pattern})$", full):
            alpha = float(value)
            break
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def _fuse(layer: int, fused: str, shards: dict[str, dict[str, torch.Tensor]], cfg: dict, shapes: BaseShapes,
          max_rank: int) -> tuple[Pair, list[int]]:
    """One fused module's (A, B) in float32, validated shard by shard; and the shards' ranks."""
    out_f = shapes.out_features(fused)
    a_rows, placed, ranks, row = [], [], [], 0
    for module, out_size in shapes.shards(fused):
        if module in shards:
            a, b = shards[module]["A"].float(), shards[module]["B"].float()
            rank = _check_pair(layer, module, a, b, shapes.projections[module], max_rank)
            a_rows.append(a)
            placed.append((row, out_size, b * _scale(cfg, layer, module, rank)))
            ranks.append(rank)
        row += out_size
    a_fused = torch.cat(a_rows, dim=0)  # [R, in]
    b_fused = torch.zeros(out_f, a_fused.shape[0])  # [out, R], block-diagonal
    spans, col = [], 0
    for row, size, b in placed:
        b_fused[row : row + size, col : col + b.shape[1]] = b
        spans.append((row, row + size, col, col + b.shape[1]))
        col += b.shape[1]
    return Pair(a_fused.contiguous(), b_fused, torch.tensor(spans, dtype=torch.long)), ranks


def _check_pair(layer: int, module: str, a: torch.Tensor, b: torch.Tensor, shape: tuple[int, int],
                max_rank: int) -> int:
    in_f, out_f = shape
    rank = a.shape[0]
    where = f"layer {layer} {module}"
    if b.shape[1] != rank:
        raise LoraShapeError(FIELD, f"{where}: lora_A has rank {rank} but lora_B {list(b.shape)} has {b.shape[1]}")
    if a.shape[1] != in_f or b.shape[0] != out_f:
        raise LoraBaseMismatch(FIELD, f"{where}: the adapter maps {a.shape[1]} -> {b.shape[0]} features; the base "
                               f"model's {module} maps {in_f} -> {out_f} (an adapter for another base model)")  # fmt: skip
    if rank > max_rank:
        raise LoraRankTooHigh(FIELD, f"{where}: rank {rank} exceeds max_lora_rank ({max_rank})")
    return rank
