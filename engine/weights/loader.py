"""Load a ModelSource's weights (safetensors or GGUF, engine/weights/model_source.py) into our model classes.

Tensors come one at a time (memory-mapped files; GGUF tensors dequantized one by one); each is cast
and copied into its (possibly fused) parameter, so the checkpoint is never held whole in RAM. The
load time and the process's peak RSS are logged.
"""

from __future__ import annotations

import logging
import resource
import sys
import time

import torch
from tqdm.auto import tqdm

from engine.models import model_class
from engine.models.llama import LlamaForCausalLM
from engine.weights.model_source import ModelSource

log = logging.getLogger("tokenmill.engine")


def load_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device, max_positions: int, show_progress: bool = True,
    held: frozenset[str] = frozenset(),
) -> LlamaForCausalLM:
    """The model of `source` in `dtype` on `device`, every parameter loaded (ValueError otherwise).
    held: checkpoint names the caller keeps in another form (GGUF blocks, engine/weights/gguf/blocks.py):
    the source does not yield them, their parameters stay unwritten (untouched pages: no memory) and
    count as loaded, for the caller to replace."""
    t0 = time.perf_counter()
    cls = model_class(getattr(source.hf_config, "architectures", None))
    with torch.device("meta"):
        model = cls(source.hf_config, max_positions)
    model = model.to(dtype=dtype).to_empty(device=device)
    params = dict(model.named_parameters())
    loaded: set[str] = {tag for name in held if (tag := _target(model, name)) is not None}
    # disable=None: a bar only on a terminal (server logs and test output stay clean)
    with tqdm(desc=f"loading {source.path.name}", total=len(source.weights), unit="tensor",
              disable=None if show_progress else True) as bar:  # fmt: skip
        for name, tensor in source.weights:
            target = _load_one(model, params, name, tensor)
            if target:
                loaded.add(target)
            bar.update(1)
    _check_complete(model, params, loaded)
    model.after_load(dtype, device)
    log.info("loaded %s (%s) into %s on %s in %.1fs; peak RSS %.0f MiB", source.path.name, source.format,
             str(dtype).removeprefix("torch."), device, time.perf_counter() - t0, peak_rss_bytes() / 2**20)
    return model.eval()


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes. Linux: VmHWM, the peak of this program
    (ru_maxrss would carry over the peak of the process that exec'd it); elsewhere ru_maxrss."""
    hwm = _proc_status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS reports bytes, others KiB


def rss_bytes() -> int | None:
    """The current resident set size in bytes (Linux; None elsewhere)."""
    rss = _proc_status_kib("VmRSS")
    return None if rss is None else rss * 1024


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _target(model: LlamaForCausalLM, name: str) -> str | None:
    """The loaded-key tag of a checkpoint tensor: its parameter, "#shard" for a fused one, "#expert.shard"
    for one expert's matrix of a stacked parameter; None: not loaded."""
    if "rotary_emb" in name or (name == "lm_head.weight" and model.tie_word_embeddings):
        return None
    name = model.checkpoint_name(name)
    slot = model.expert_slot(name)
    if slot is not None:
        return slot.tag
    for sub, (fused, shard) in model.packed.items():
        if sub in name.split("."):
            return f"{name.replace(sub, fused)}#{shard}"
    return name


def _load_one(model: LlamaForCausalLM, params: dict, name: str, tensor: torch.Tensor) -> str | None:
    """Copy one checkpoint tensor into its (possibly fused) parameter. Returns a loaded-key tag."""
    if "rotary_emb" in name:
        return None
    if name == "lm_head.weight" and model.tie_word_embeddings:
        return None  # some tied checkpoints carry a copy
    ckpt_name, name = name, model.checkpoint_name(name)
    slot = model.expert_slot(name)
    if slot is not None:  # stacked experts [E, ...]: one expert's gate, up or down, or the whole stack
        param = params.get(slot.param)
        if param is None:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in the model")
        if slot.expert is not None and slot.expert >= param.shape[0]:
            raise ValueError(f"checkpoint tensor {ckpt_name!r}: expert {slot.expert} of {param.shape[0]}")
        _copy(model.expert_destination(param.data, slot), tensor, ckpt_name)
        return slot.tag
    parts = name.split(".")
    for sub, (fused, shard) in model.packed.items():
        if sub in parts:
            fused_name = name.replace(sub, fused)
            param = params.get(fused_name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            sizes = model.shard_sizes(fused, param.shape[0])
            offset = sum(sizes[:shard])
            dst = param.data.narrow(0, offset, sizes[shard])
            _copy(dst, tensor, name)
            return f"{fused_name}#{shard}"
    param = params.get(name)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    _copy(param.data, tensor, name)
    return name


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)  # casts to the model dtype and moves to its device


def _check_complete(model: LlamaForCausalLM, params: dict, loaded: set[str]) -> None:
    expected: set[str] = set()
    for name, param in params.items():
        if model.expert_slot(name) is not None:  # stacked experts: whole, per shard, or per expert and shard
            expected.update(model.expert_missing(name, param.shape, loaded))
            continue
        fused = next((f for f, _ in model.packed.values() if f"{f}." in name), None)
        if fused is None:
            expected.add(name)
        else:
            n = len(model.shard_sizes(fused, param.shape[0]))
            expected.update(f"{name}#{i}" for i in range(n))
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
