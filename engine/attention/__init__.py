"""Attention over the paged KV cache, behind a small backend interface."""

from engine.attention.base import AttentionBackend, AttentionMetadata, BatchLayout
from engine.attention.torch_ref import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "BatchLayout", "TorchAttentionBackend", "select_backend"]


def select_backend(device: str) -> AttentionBackend:
    """The best backend available on this device; the PyTorch reference is the fallback everywhere."""
    return TorchAttentionBackend()
