"""Token bitmasks applied to logits. The bitmask layout is the backends' (engine/structured/backend.py):
int32 [rows, ceil(vocab / 32)], bit j of word w allows token 32 * w + j.

The masks are applied by xgrammar's kernels (C++ on the CPU, Triton on CUDA) when xgrammar is installed:
on this CPU they mask 16 rows of 49,152 logits in well under a millisecond, where unpacking the bits in
torch and filling took several (10-45 ms on a loaded machine). The torch fallback serves other backends.
"""

from __future__ import annotations

import torch

try:
    from xgrammar import apply_token_bitmask_inplace as _kernel
except ImportError:  # another backend without xgrammar: the torch fallback
    _kernel = None


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask on the CPU (where the matchers write): int32 [rows, ceil(vocab / 32)]."""
    return torch.full((rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """The bitmask row of bool [vocab] `allowed`: int32 [ceil(vocab / 32)]."""
    words = -(-allowed.shape[0] // 32)
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[: allowed.shape[0]] = allowed.to(torch.int64)
    packed = (bits.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # two's complement


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab]: True where the bitmask allows the token."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[i, t] = -inf for each i in `rows` where bitmask[i] forbids t. logits: float32
    [n, vocab]; bitmask: [n, words] on the CPU. Other rows are not touched."""
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if _kernel is not None and logits.dtype == torch.float32:
        _kernel(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
        return
    index = torch.tensor(rows, device=logits.device)
    allowed = allowed_tokens(bitmask[index], logits.shape[1])
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
