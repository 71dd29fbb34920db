"""Token bitmasks applied to logits. The bitmask layout is the backends' (engine/structured/backend.py):
int32 [rows, ceil(vocab / 32)], bit j of word w allows token 32 * w + j.

Rows that allow few tokens (most steps of a JSON schema: a key, a separator, a digit) take the sparse
path (CPU): the row is set to -inf and its allowed logits put back, found from its few non-zero words. Other
rows go to xgrammar's kernel (C++ on the CPU, Triton on CUDA) when xgrammar is installed, else to a
torch fallback. Why two paths: xgrammar's CPU kernel writes -inf token by token, which costs 3-9 ms for
16 rows of 49,152 logits that allow 2 tokens each (0.6 ms when most are allowed), where the sparse path
takes well under a millisecond; unpacking every bit in torch takes tens of ms.
"""

from __future__ import annotations

import numpy as np
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


# A row takes the sparse path when at most this share of its words allow anything.
SPARSE_WORDS_SHARE = 1 / 16


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[i, t] = -inf for each i in `rows` where bitmask[i] forbids t. logits: float32
    [n, vocab]; bitmask: [n, words] on the CPU. Other rows are not touched."""
    if not rows:
        return
    sparse: list[int] = []
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        live = np.count_nonzero(bitmask.numpy()[rows], axis=1)  # per row: words that allow something
        sparse = [r for r, n in zip(rows, live.tolist(), strict=True) if n <= bitmask.shape[1] * SPARSE_WORDS_SHARE]
    if sparse:
        _apply_sparse(logits.numpy(), bitmask.numpy(), sparse)
    dense = [r for r in rows if r not in sparse] if sparse else rows
    if dense:
        _apply_dense(logits, bitmask, dense)


def _apply_sparse(logits: np.ndarray, bitmask: np.ndarray, rows: list[int]) -> None:
    """CPU rows that allow few tokens: -inf everywhere, then their allowed logits put back. numpy, so
    single-threaded: torch's thread pool waits for a busy core (ms per op on a loaded machine)."""
    words = bitmask[rows]  # [R, words]
    at_row, at_word = np.nonzero(words)  # each non-zero word
    bits = (words[at_row, at_word][:, None] >> np.arange(32, dtype=np.int32)) & 1  # [K, 32]
    hit, bit = np.nonzero(bits)
    row, token = np.asarray(rows)[at_row[hit]], at_word[hit] * 32 + bit
    inside = token < logits.shape[1]
    row, token = row[inside], token[inside]
    kept = logits[row, token]
    logits[rows] = -np.inf
    logits[row, token] = kept


def _apply_dense(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if _kernel is not None and logits.dtype == torch.float32:
        _kernel(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
        return
    index = torch.tensor(rows, device=logits.device)
    allowed = allowed_tokens(bitmask[index], logits.shape[1])
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
