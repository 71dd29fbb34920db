"""Start-up decisions of the torch engine: device, dtype, threads, block size, context length, KV-cache
size. (The step's token budget is a config default, engine/config/engine_config.py; a model's stop
tokens come with its source, engine/weights/.)"""

from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig
from engine.kernels.cpu_kernels import cpu_has_bf16
from engine.kv.cache import KVCacheSpec

log = logging.getLogger("tokenmill.engine")

CPU_DEFAULT_KV_BYTES = 1 << 30  # 1 GiB

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but CUDA is not available")
    return dev


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(ckpt, str):
        ckpt = _DTYPES.get(ckpt)
    if device.type == "cpu":
        # bf16 pays for bf16 checkpoints; fp16 on CPU is slow: use fp32. A quantized GGUF file (4-8 bit
        # weights: bf16's 8 significant bits lose nothing that matters next to them) serves in bf16
        # where bf16 is fast here (cpu_bf16_fast): half float32's bytes a decode step reads, 1.8-2x its
        # output tok/s on an AVX2-only Zen 3 (docs/ENGINE.md); float32 elsewhere and with dtype="float32".
        if ckpt == torch.bfloat16 or (getattr(hf_config, "tokenmill_quantized", False) and cpu_bf16_fast()):
            return torch.bfloat16
        return torch.float32
    return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16


def cpu_bf16_fast() -> bool:
    """Whether bf16 linears are fast on this CPU: it has bf16 instructions, or this repository's bf16
    linear kernel has a path here (AVX2 + FMA and up: it widens bf16 in registers, engine/kernels/).
    Without either, bf16 products go to PyTorch's generic code, slower than float32's."""
    if cpu_has_bf16():
        return True
    from engine.kernels import cpu_kernels

    return cpu_kernels.linear_path("bf16") != "none"


def apply_cpu_threads(threads: int | None, device: torch.device) -> None:
    """torch's intra-op thread count for a CPU engine (process-wide: every OpenMP region, the C++
    kernels' at::parallel_for included). None leaves torch's default, one thread per core."""
    if threads is not None and device.type == "cpu" and torch.get_num_threads() != threads:
        log.info("CPU threads: %d (was %d)", threads, torch.get_num_threads())
        torch.set_num_threads(threads)


def resolve_block_size(block_size: int | None, device: torch.device) -> int:
    """32 tokens on CPU: the torch backend gathers whole blocks per decode step, and 4 KiB (bf16,
    head_dim 64) contiguous runs copy about twice as fast as 2 KiB ones (bench-135m, batch 32: the
    step is ~6% faster). 16 on CUDA, where the Triton kernels read the cache in place."""
    if block_size is not None:
        return block_size
    return 32 if device.type == "cpu" else 16


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    # A sliding window (Mistral, Qwen2 with its window on) does not cap the context: every attention
    # backend masks to each layer's window (engine/models/windows.py), and LongRoPE (Phi-3) serves its
    # long factors past original_max_position_embeddings (engine/models/rope.py), so the model serves
    # its full max_position_embeddings.
    model_max = int(getattr(hf_config, "max_position_embeddings", 2048) or 2048)
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's limit ({model_max})")
    return config.max_model_len


def kv_spec(hf_config, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
    from engine.models.llama import head_dim_of

    return KVCacheSpec(
        num_layers=hf_config.num_hidden_layers,
        num_kv_heads=hf_config.num_key_value_heads,
        head_dim=head_dim_of(hf_config),
        block_size=block_size,
        dtype=dtype,
    )


def kv_budget_bytes(config: EngineConfig, device: torch.device, profile_peak_bytes: int = 0) -> int:
    """Bytes for the KV cache: kv_cache_memory when set; on CUDA otherwise what the utilisation
    target leaves after everything in use now and the activation peak measured by profiling."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if device.type != "cuda":
        return CPU_DEFAULT_KV_BYTES
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    budget = int(total * config.gpu_memory_utilization) - in_use - profile_peak_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {config.gpu_memory_utilization} leaves no room for the KV cache "
            f"({in_use / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB)"
        )
    return budget
