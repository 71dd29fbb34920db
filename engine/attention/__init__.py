"""Attention over the paged KV cache, behind a small backend interface.

Backends: "torch" (torch_ref.py, the reference, runs everywhere), "cpu" (cpu_backend.py, the
reference with this repository's C++ decode kernels; CPU, needs a C++ compiler the first time) and
"triton" (triton_backend.py, this repository's Triton kernels; CUDA, or the CPU under the Triton
interpreter for tests). The Triton modules are imported only when that backend is chosen, so
nothing here needs triton.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, BatchLayout
from engine.attention.torch_ref import TorchAttentionBackend
from engine.config.engine_config import ATTENTION_BACKENDS

__all__ = [
    "ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "BatchLayout", "TorchAttentionBackend",
    "for_sinks", "select_backend", "triton_unavailable_reason",
]

MIN_TRITON_CAPABILITY = (8, 0)  # bf16 tl.dot

log = logging.getLogger("tokenmill.engine")


def triton_unavailable_reason(device: torch.device) -> str | None:
    """None when the Triton backend can run on `device`, else why it cannot (one line).

    On CUDA it also builds a C module through Triton's launcher build and launches one tiny kernel
    (triton_probe.py): a first request must not be the first to find that the compiler, Python.h or
    a writable Triton cache is missing. On the CPU the interpreter needs none of them."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "on the CPU the Triton kernels run only under the Triton interpreter (TRITON_INTERPRET=1)"
    if device.type not in ("cpu", "cuda"):
        return f"no Triton kernels for device type {device.type!r}"
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"triton cannot be imported ({type(exc).__name__}: {exc})"
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < MIN_TRITON_CAPABILITY:
            return f"compute capability {cap[0]}.{cap[1]} is below {MIN_TRITON_CAPABILITY[0]}.{MIN_TRITON_CAPABILITY[1]}"
        from engine.attention import triton_probe

        return triton_probe.toolchain_reason() or triton_probe.kernel_reason(device)
    return None


def select_backend(
    device: str | torch.device,
    preference: str = "auto",
    dtype: torch.dtype = torch.float32,
    *,
    probe: Callable[[torch.device], str | None] = triton_unavailable_reason,
    num_sms: int | None = None,
) -> AttentionBackend:
    """The attention backend for `device`.

    "auto": the Triton kernels on CUDA when they can run there, else the reference; on the CPU the
    C++ decode kernels when they build, else the reference. "torch": the reference. "triton" and
    "cpu": those kernels, or ValueError saying why they cannot run.
    `probe` (tests pass a fake) says why Triton cannot run; `num_sms` defaults to the device's count.
    """
    if preference not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {preference!r}")
    dev = torch.device(device)
    if preference == "torch":
        return TorchAttentionBackend()
    if preference == "cpu" or (preference == "auto" and dev.type == "cpu"):
        return _cpu_backend(dev, required=preference == "cpu")
    if preference == "auto" and dev.type != "cuda":
        return TorchAttentionBackend()
    reason = probe(dev)
    if reason is not None:
        if preference == "triton":
            raise ValueError(f"attention_backend 'triton' cannot run on {dev}: {reason}")
        log.warning("Triton attention unavailable (%s); using the PyTorch reference backend", reason)
        return TorchAttentionBackend()
    from engine.attention.triton_backend import TritonAttentionBackend

    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
    return TritonAttentionBackend(num_sms=num_sms, dtype=dtype)


def _cpu_backend(dev: torch.device, required: bool) -> AttentionBackend:
    from engine.kernels import cpu_kernels
    reason = "the C++ kernels run on the CPU only" if dev.type != "cpu" else cpu_kernels.load("attention")
    if reason is None:
        from engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if required:
        raise ValueError(f"attention_backend 'cpu' cannot run on {dev}: {reason}")
    log.warning("CPU attention kernels unavailable (%s); using the PyTorch reference backend", reason)
    return TorchAttentionBackend()


def for_sinks(backend: AttentionBackend, preference: str) -> AttentionBackend:
    """The backend for a model with learned attention sinks (GPT-OSS): `backend` when it takes them;
    else, for "auto", the PyTorch reference with a warning (an error under TOKENMILL_REQUIRE_KERNELS=1:
    no silent fallback), and for a backend asked for by name a ValueError saying why."""
    reason = backend.sinks_unsupported
    if reason is None:
        return backend
    from engine.kernels.cpu_kernels import required

    if preference != "auto" or required():
        why = "TOKENMILL_REQUIRE_KERNELS=1" if preference == "auto" else f"attention_backend {preference!r}"
        raise ValueError(f"the model has attention sinks and {why}: {reason}")
    log.warning("attention sinks: %s; using the PyTorch reference backend", reason)
    return TorchAttentionBackend()
