"""Triton kernels for attention over the paged KV cache, and their launchers.

Cache layout (the same as torch_ref.py), per layer and for K and V alike:
[num_kv_heads, num_blocks * block_size, head_dim], head_dim contiguous. Position p of a sequence
lives in row `slot = block_table[p // block_size] * block_size + p % block_size` of its KV head.

  store_kv       scatter the step's new K/V rows to their slots; slot -1 stores nothing
  paged_decode   one query token per sequence; a program holds every query head of one KV head (GQA
                 without repeating K/V) over one partition of the context; with num_splits > 1 the
                 partitions are merged by a second kernel (flash-decoding)
  paged_prefill  tiles of BLOCK_M query rows of a prefill chunk, causal with an offset: row r of a
                 chunk of q_len tokens ending at context length c sits at position c - q_len + r and
                 sees positions 0..c - q_len + r (cached prefix and earlier chunks included)

With WINDOW (a sliding window of `window` positions) the query at position p sees positions
p - window + 1 .. p only, and the kernels read no block before that (a freed block may sit in the
table there); with SOFTCAP each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2); with
SINKS each query head's sink logit (GPT-OSS) joins its softmax's denominator after the context (m =
max(m, sink), l += exp(sink - m); no value), in the merge kernel when the context is split.

Softmax runs online in float32. Offsets into the cache are int64: one layer's cache can hold more
than 2**31 elements. Kernels run on CUDA, and on CPU tensors under the Triton interpreter
(TRITON_INTERPRET=1 before this module is imported), which is how the tests run them.

The interpreter keeps bfloat16 as raw uint16 and its tl.dot multiplies those bits (triton 3.9,
runtime/interpreter.py create_dot), so with F32 set (interpreter, or float32 caches) every dot runs
on float32 operands in IEEE precision; on GPU with 16-bit caches the dots take the 16-bit operands.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SPLITS = 32  # most context partitions of one decode sequence (the merge kernel's tile)
MIN_PARTITION = 256  # fewest context tokens worth a partition of their own
# Warps per decode/prefill program. The per-token gather (block table -> slot -> row) holds a
# [tile, head_dim] tensor of int64 offsets: with 4 warps the 16-bit prefill tile needs 253 registers
# per thread at head_dim 64 and spills at 128 (cuobjdump on sm_90 builds, triton_aot.py); 8 warps
# need 112 to 197, without spills. Not tuned on a GPU yet.
ATTN_WARPS = 8


@triton.jit
def _mm(a, b, F32: tl.constexpr):
    """a @ b with a float32 accumulator."""
    if F32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(a, b)
    return acc


@triton.jit
def _softcap(s, softcap):
    """softcap * tanh(s / softcap), tanh from exp (no tl.tanh): sign(x) (1 - e) / (1 + e), e = exp(-2|x|)."""
    x = s / softcap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t) * softcap


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ch, stride_cs,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per token: its [kv_heads, head_dim] K and V rows
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # slot -1 empties the head_dim range (a scalar `slot >= 0` in the mask would do the same, but the
    # interpreter turns block & scalar masks into int32 and refuses them)
    d_end = (slot >= 0).to(tl.int32) * HEAD_DIM
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < d_end)
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = h[:, None].to(tl.int64) * stride_ch + slot * stride_cs + d[None, :]
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


# Integers that change from step to step are not specialised on (each new value class would compile
# the kernel again): the split count and the block-table width.
@triton.jit(do_not_specialize=["num_splits", "stride_bt", "window"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr,
    scale, num_heads, num_splits, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_cs, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CACHE_BLOCK: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    # grid: (sequences, kv_heads, num_splits)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    lo = 0  # the first position the query (at ctx - 1) sees
    if WINDOW:
        lo = tl.maximum(ctx - window, 0)
    # partitions of whole BLOCK_N tiles of [lo, ctx); the last ones may be empty (short contexts, padded batches)
    part = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * part
    end = tl.minimum(start + part, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g  # query heads of this KV head: [BLOCK_G]
    gd_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=gd_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    cache_head = kv_head.to(tl.int64) * stride_ch
    table = block_tables_ptr + seq * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(table + pos // CACHE_BLOCK, mask=valid, other=0).to(tl.int64)
        slot = block * CACHE_BLOCK + pos % CACHE_BLOCK
        offs = cache_head + slot[:, None] * stride_cs + d[None, :]
        kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
        s = _mm(q, tl.trans(k), F32) * scale  # [BLOCK_G, BLOCK_N]
        if SOFTCAP:
            s = _softcap(s, softcap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds a valid position
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, F32)
        m_i = m_new

    if SPLIT:
        # partial results, merged by _merge_kernel; empty partitions write m=-inf, l=0, acc=0
        row = (seq * num_heads + heads) * num_splits + split  # [BLOCK_G]
        g_mask = g < GROUP
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=gd_mask)
    else:
        if SINKS:  # the head's sink logit joins the denominator, no value: m = max(m, sink), l += exp(sink - m)
            sink = tl.load(sinks_ptr + heads, mask=g < GROUP, other=0.0)
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.exp(sink - m_new)
            acc = acc * alpha[:, None]
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # context 0 (padding): zeros, not NaN
        out = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=gd_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, sinks_ptr, num_heads, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr,
):
    # grid: (sequences, query heads); rescales each partition's sums to the common maximum
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    row = (seq * num_heads + head) * num_splits + s
    m = tl.load(part_m_ptr + row, mask=s_mask, other=float("-inf"))
    sums = tl.load(part_l_ptr + row, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    if SINKS:  # the head's sink logit: one more partition with sum 1 and no value
        sink = tl.load(sinks_ptr + head)
        m_max = tl.maximum(m_max, sink)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every partition empty: context 0
    w = tl.exp(m - m_max)
    denom = tl.sum(sums * w, 0)
    if SINKS:
        denom += tl.exp(sink - m_max)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
                  mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=["stride_bt", "window"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr,
    q_starts_ptr, q_lens_ptr, context_lens_ptr, tile_seqs_ptr, tile_rows_ptr, sinks_ptr, scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_cs, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CACHE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, F32: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    # grid: (query tiles of all prefill chunks, query heads)
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(tile_seqs_ptr + tile).to(tl.int64)  # which prefill chunk
    row0 = tl.load(tile_rows_ptr + tile).to(tl.int32)  # its first query row in the chunk
    q_start = tl.load(q_starts_ptr + seq)  # offset of the chunk's first token in the packed batch
    q_len = tl.load(q_lens_ptr + seq).to(tl.int32)
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)

    rows = row0 + tl.arange(0, BLOCK_M)
    row_valid = rows < q_len
    q_pos = ctx - q_len + rows  # absolute positions of the query rows
    tok = (q_start + rows).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    cache_head = (head // GROUP).to(tl.int64) * stride_ch
    table = block_tables_ptr + seq * stride_bt
    end = tl.minimum(ctx, ctx - q_len + row0 + BLOCK_M)  # no row of this tile sees past here
    lo = 0  # no row of this tile sees before here (its first row's window start)
    if WINDOW:
        lo = tl.maximum(ctx - q_len + row0 - window + 1, 0)
    # a row whose window starts later may see nothing in the first tiles: its running max stays
    # -inf there, and m_safe keeps exp() off -inf - -inf
    for n0 in range(lo, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(table + pos // CACHE_BLOCK, mask=valid, other=0).to(tl.int64)
        slot = block * CACHE_BLOCK + pos % CACHE_BLOCK
        offs = cache_head + slot[:, None] * stride_cs + d[None, :]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
        s = _mm(q, tl.trans(k), F32) * scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            s = _softcap(s, softcap)
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, F32)
        m_i = m_new

    if SINKS:  # the head's sink logit joins each row's denominator (no value)
        sink = tl.load(sinks_ptr + head)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out = out_ptr + tok[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


# ---- launchers ----------------------------------------------------------------------------------

INTERPRETED = type(_store_kv_kernel).__name__ == "InterpretedFunction"  # decided when this module loaded


def _check_device(*tensors: torch.Tensor) -> None:
    if not INTERPRETED and any(t.device.type != "cuda" for t in tensors):
        raise RuntimeError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before import)")


def _use_f32(dtype: torch.dtype) -> bool:
    return INTERPRETED or dtype == torch.float32


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, kv_heads, D] (rows may be strided); slot_mapping: [T] int, -1 stores nothing."""
    t, kvh, d = k.shape
    if t == 0:
        return
    _check_device(k, k_cache)
    if k.stride(2) != 1 or v.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(2) != 1:
        raise ValueError("k_cache and v_cache must share a layout with contiguous head_dim")
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        NUM_KV_HEADS=kvh, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(kvh), BLOCK_D=triton.next_power_of_2(d),
    )


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, out: torch.Tensor, scale: float, block_size: int, num_splits: int,
    block_n: int = 64, window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> None:
    """q, out: [B, H, D] (out may be a row slice of a larger tensor); block_tables: [B, W] int;
    context_lens: [B] int (0: padding, writes zeros); window, softcap, sinks: as AttentionBackend.forward.
    Writes out."""
    b, h, d = q.shape
    kvh = k_cache.shape[0]
    if b == 0:
        return
    _check_device(q, k_cache)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    group = h // kvh
    split = num_splits > 1
    if split:  # [B, H, splits] partial max / sum, [B, H, splits, D] partial outputs
        part_m = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    sinks_f = _sinks(sinks, q.device)
    _decode_kernel[(b, kvh, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_m, part_l, part_acc, sinks_f,
        scale, h, num_splits, window or 0, softcap or 1.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=d, CACHE_BLOCK=block_size, SPLIT=split,
        BLOCK_G=_pow2(group), BLOCK_D=_pow2(d), BLOCK_N=block_n, F32=_use_f32(q.dtype),
        WINDOW=window is not None, SOFTCAP=softcap is not None, SINKS=sinks is not None, num_warps=ATTN_WARPS,
    )
    if split:
        _merge_kernel[(b, h)](
            part_m, part_l, part_acc, out, sinks_f, h, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_S=MAX_SPLITS, BLOCK_D=triton.next_power_of_2(d), SINKS=sinks is not None,
        )


def _sinks(sinks: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The sink logits as float32 [H] for the kernels; without sinks a one-element placeholder (not read)."""
    if sinks is None:
        return torch.zeros(1, dtype=torch.float32, device=device)
    return sinks.to(device=device, dtype=torch.float32).contiguous()


def paged_prefill(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    block_tables: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor, context_lens: torch.Tensor,
    tile_seqs: torch.Tensor, tile_rows: torch.Tensor, scale: float, block_size: int,
    block_m: int, block_n: int, window: int | None = None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """q, out: [T, H, D] packed; per prefill chunk: block_tables [P, W], q_starts, q_lens,
    context_lens [P]; per query tile: tile_seqs (its chunk) and tile_rows (its first row, a multiple
    of block_m); window, softcap: as AttentionBackend.forward. Writes the chunks' rows of out."""
    num_tiles = tile_seqs.shape[0]
    if num_tiles == 0:
        return
    _check_device(q, k_cache)
    _, h, d = q.shape
    group = h // k_cache.shape[0]
    _prefill_kernel[(num_tiles, h)](
        q, k_cache, v_cache, out, block_tables, q_starts, q_lens, context_lens, tile_seqs, tile_rows,
        _sinks(sinks, q.device), scale, window or 0, softcap or 1.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=d, CACHE_BLOCK=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=_pow2(d), F32=_use_f32(q.dtype), WINDOW=window is not None, SOFTCAP=softcap is not None,
        SINKS=sinks is not None, num_warps=ATTN_WARPS,
    )


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Context partitions per decode sequence: a power of two that brings the grid to about two
    programs per multiprocessor, with at least MIN_PARTITION tokens per partition."""
    programs = max(1, num_seqs * num_kv_heads)
    want = (2 * num_sms) // programs
    by_len = max_context // MIN_PARTITION
    n = min(want, by_len, MAX_SPLITS)
    return 1 if n < 2 else 1 << (n.bit_length() - 1)
