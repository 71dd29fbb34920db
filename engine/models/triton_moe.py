"""The mixture-of-experts MLP on a GPU as two grouped GEMMs in Triton (the design of vLLM's fused_moe:
pairs aligned to blocks per expert, one program per block of one expert's pairs and tile of columns).

Shapes: T tokens, H hidden, E experts, K experts per token, I an expert's width, P = T*K (token,
expert) pairs, pair p = t*K + k (ids.reshape(-1)'s order), BM = Tiles.block_m.

  align       (torch, no host sync) the pairs sorted by expert (stable), each expert's run padded to a
              multiple of BM with the sentinel P: sorted_pairs int32 [P + E*(BM - 1)] and the expert of
              each block of BM entries, block_expert int32 [cdiv(P + E*(BM - 1), BM)], -1 past the last
              real block (those programs exit at once). The buffer is sized for the worst case, so the
              grid does not depend on the counts and nothing is read back to the host.
  gate_up     grid (blocks, cdiv(I, BN)): the block's BM pairs times gate rows n and up rows I + n of
              expert e's gate_up [E, 2I, H], looping over H in BLOCK_K steps, each weight tile read
              once for all BM rows; h[p, n] = silu(gate) * up in float32, stored in the model dtype
              (h [P, I], indexed by pair: padding rows store nothing).
  down        grid (blocks, cdiv(H, BN)): h rows of the block times expert e's down [E, H, I]; the
              routing weight (float32) multiplied into the float32 accumulator; y [P, H] float32.
  sum back    grid (T, cdiv(H, BN)): out[t] = sum of y[t*K + k] over its K pairs in ascending expert
              id (the order the host gives, argsort of each token's ids), float32, one rounding to the
              model dtype.

Batch invariance (what the kernels guarantee): a token's output depends only on its own row, its
routing and the expert weights, never on the other tokens of the step or on where its pairs fall in
a block. Each output element is one row of a tile times one column, reduced over the input features
in BLOCK_K steps in a fixed order (the tile sizes are fixed: never chosen from the batch); the rows a
tile shares with it do not enter its sum (tensor-core MMAs compute each element from its own row and
column); the K contributions are summed in ascending expert order in float32, not by atomics. This
holds for one device, one Triton build and fixed Tiles; the PyTorch loop (moe.grouped_experts) on
CUDA sums with index_add_, whose order CUDA does not fix.

Numerics against the PyTorch loop: the gate_up product, the activation and the weighting are
float32 here, rounded once to the model dtype for h and once for the output (the loop rounds after
each product and after the weighting), so bf16 results differ by rounding only; float32 dots use
input_precision="ieee" (no TF32).

Biases and GPT-OSS's clamped SwiGLU with interleaved gate/up rows are parameters (ExpertAct,
gate_up_bias, down_bias): the bias is added to the float32 accumulators before the activation and
before the routing weight. SparseMoeBlock passes neither (its experts have none); a GPT-OSS block
would pass its own. Not covered: quantized (MXFP4, INT8, GGUF) experts. Tiles are not tuned on a GPU: the kernels have run only under the
Triton interpreter here (TRITON_INTERPRET=1 before this module is imported; CPU tensors), where, as
in engine/attention/triton_kernels.py, every product takes float32 operands (the interpreter's tl.dot
multiplies bf16's raw bits), and is a broadcast sum rather than tl.dot (_mm: numpy's matmul is not
row-independent), so under the interpreter the tests check the layout, masks and sums, and on a GPU
(docs/GPU.md's check) the tl.dot path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class MoeTiles:
    """Tile sizes (powers of two, >= 16 for tl.dot). block_m: pairs per block (the alignment unit);
    block_n: output columns per program; block_k: input features per step of the loop."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64


@triton.jit
def _mm(a, b, F32: tl.constexpr, ROWWISE: tl.constexpr):
    """a [M, K] @ b [K, N] with a float32 accumulator (F32: float32 operands, IEEE). ROWWISE (the
    interpreter): a broadcast product summed over K, each element from its own row in one order,
    because the interpreter's tl.dot is numpy's matmul, whose BLAS rounds a row differently by its
    place in the tile (measured: 74 of 200 rows of a 16 x 16 product), which the GPU's dot does not."""
    if ROWWISE:
        acc = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    elif F32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(a, b)
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, bias_ptr, h_ptr, sorted_ptr, block_expert_ptr,
    stride_xt, stride_we, stride_wr, stride_wk, stride_ht, stride_be, alpha, limit,
    P: tl.constexpr, TOP_K: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr,
    ROW_STEP: tl.constexpr, UP_OFF: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, ROWWISE: tl.constexpr,
):
    # grid: (blocks, cdiv(I, BN)). h[p, n] = act(x[p // K] . gate_e[n] (+ b), x[p // K] . up_e[n] (+ b)),
    # gate row n * ROW_STEP, up row n * ROW_STEP + UP_OFF (split halves: 1, I; interleaved: 2, 1)
    blk = tl.program_id(0)
    e = tl.load(block_expert_ptr + blk).to(tl.int64)
    if e >= 0:
        rows = blk * BM + tl.arange(0, BM)
        pair = tl.load(sorted_ptr + rows).to(tl.int64)  # [BM]; P: padding
        valid = pair < P
        tok = tl.where(valid, pair // TOP_K, 0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_mask = n < INTER
        row_g = n[None, :].to(tl.int64) * ROW_STEP  # [1, BN]: gate rows
        w_gate = w_ptr + e * stride_we + row_g * stride_wr
        w_up = w_gate + UP_OFF * stride_wr
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, H, BK):
            k = k0 + tl.arange(0, BK)
            k_mask = k < H
            a = tl.load(x_ptr + tok[:, None] * stride_xt + k[None, :], mask=valid[:, None] & k_mask[None, :],
                        other=0.0)  # [BM, BK]
            wm = k_mask[:, None] & n_mask[None, :]
            g = tl.load(w_gate + k[:, None] * stride_wk, mask=wm, other=0.0)  # [BK, BN]: gate_e^T tile
            u = tl.load(w_up + k[:, None] * stride_wk, mask=wm, other=0.0)
            acc_g += _mm(a, g, F32, ROWWISE)
            acc_u += _mm(a, u, F32, ROWWISE)
        if HAS_BIAS:
            b_row = bias_ptr + e * stride_be + row_g
            acc_g += tl.load(b_row, mask=n_mask[None, :], other=0.0).to(tl.float32)
            acc_u += tl.load(b_row + UP_OFF, mask=n_mask[None, :], other=0.0).to(tl.float32)
        if CLAMPED:  # GPT-OSS: gate <= limit, |up| <= limit, gate * sigmoid(alpha gate) * (up + 1)
            acc_g = tl.minimum(acc_g, limit)
            acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
            h = acc_g / (1.0 + tl.exp(-alpha * acc_g)) * (acc_u + 1.0)
        else:
            h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up, float32
        tl.store(h_ptr + pair[:, None] * stride_ht + n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, bias_ptr, y_ptr, route_ptr, sorted_ptr, block_expert_ptr,
    stride_ht, stride_we, stride_wr, stride_wk, stride_yt, stride_be,
    P: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, ROWWISE: tl.constexpr,
):
    # grid: (blocks, cdiv(H, BN)). y[p, n] = route[p] * (h[p] . down_e[n] (+ bias_e[n])), float32
    blk = tl.program_id(0)
    e = tl.load(block_expert_ptr + blk).to(tl.int64)
    if e >= 0:
        rows = blk * BM + tl.arange(0, BM)
        pair = tl.load(sorted_ptr + rows).to(tl.int64)
        valid = pair < P
        safe = tl.where(valid, pair, 0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_mask = n < H
        w = w_ptr + e * stride_we + n[None, :].to(tl.int64) * stride_wr  # [1, BN]: rows n of down_e
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, INTER, BK):
            k = k0 + tl.arange(0, BK)
            k_mask = k < INTER
            a = tl.load(h_ptr + safe[:, None] * stride_ht + k[None, :], mask=valid[:, None] & k_mask[None, :],
                        other=0.0)  # [BM, BK]
            b = tl.load(w + k[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
            acc += _mm(a, b, F32, ROWWISE)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + e * stride_be + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        r = tl.load(route_ptr + safe, mask=valid, other=0.0).to(tl.float32)  # [BM]
        tl.store(y_ptr + pair[:, None] * stride_yt + n[None, :], acc * r[:, None],
                 mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _sum_kernel(y_ptr, out_ptr, korder_ptr, stride_yt, stride_ot,
                TOP_K: tl.constexpr, H: tl.constexpr, BN: tl.constexpr):
    # grid: (T, cdiv(H, BN)). out[t, n] = sum over j of y[t*K + korder[t, j], n], j ascending
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_mask = n < H
    acc = tl.zeros([BN], tl.float32)
    for j in range(TOP_K):
        k = tl.load(korder_ptr + t * TOP_K + j).to(tl.int64)
        acc += tl.load(y_ptr + (t * TOP_K + k) * stride_yt + n, mask=n_mask, other=0.0)
    tl.store(out_ptr + t * stride_ot + n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


# ---- launcher -----------------------------------------------------------------------------------

INTERPRETED = type(_gate_up_kernel).__name__ == "InterpretedFunction"  # decided when this module loaded
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, K] -> (sorted_pairs int32 [P + E*(block_m - 1)], block_expert int32 [blocks]): the pairs
    p = t*K + k sorted by expert (stable: ascending p within an expert), each expert's run starting at
    a multiple of block_m and padded with P; block_expert[b] the expert of entries b*block_m..,
    -1 for blocks past the last expert's run. All on ids' device, no host sync."""
    flat = ids.reshape(-1)  # [P]
    p, dev = flat.numel(), flat.device
    cap = p + num_experts * (block_m - 1)  # every expert's run padded: the most entries there can be
    blocks = triton.cdiv(cap, block_m)
    # [E]; not torch.bincount, which on CUDA reads the largest id back to the host to size its output
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = torch.div(counts + block_m - 1, block_m, rounding_mode="floor") * block_m  # [E]
    end_padded = torch.cumsum(padded, 0)  # [E]
    order = torch.argsort(flat, stable=True)  # [P]
    expert = flat[order]  # [P] ascending
    first = torch.cumsum(counts, 0) - counts  # [E]: each expert's first position in `order`
    dest = (end_padded - padded)[expert] + torch.arange(p, device=dev) - first[expert]  # [P]
    sorted_pairs = torch.full((blocks * block_m,), p, dtype=torch.int32, device=dev)
    sorted_pairs[dest] = order.to(torch.int32)
    starts = torch.arange(blocks, device=dev) * block_m  # [blocks]
    block_expert = torch.searchsorted(end_padded, starts, right=True)  # the run a block starts in
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


@dataclass(frozen=True)
class ExpertAct:
    """The experts' gated activation and gate_up's row layout. Default: silu(gate) * up, gate rows
    then up rows (transformers' Qwen/OLMoE/Mixtral stacking). clamped (GPT-OSS's experts): gate
    clamped above at limit, up to [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1).
    interleaved: gate row 2n, up row 2n + 1 (GPT-OSS's checkpoints)."""

    clamped: bool = False
    alpha: float = 1.702
    limit: float = 7.0
    interleaved: bool = False


def fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, tiles: MoeTiles = MoeTiles(), *, gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None, act: ExpertAct = ExpertAct()) -> torch.Tensor:  # fmt: skip
    """sum_k weights[t, k] * (down_e(act(gate_e x[t], up_e x[t])) + down_bias[e]) with e = ids[t, k],
    summed in ascending e: x [T, H], ids int64 [T, K] (a row's ids distinct), weights float32 [T, K],
    gate_up [E, 2I, H] (layout: act.interleaved), down [E, H, I], biases [E, 2I] and [E, H] (optional),
    in x's dtype; the weights may be strided views (GPT-OSS's [E, H, 2I] / [E, I, H] stacks as
    .transpose(1, 2): read in place, not copied) -> [T, H] in x's dtype (moe.grouped_experts' contract with stacked_expert, for the
    default act). Ids are range-checked only on the CPU."""
    _check(x, ids, weights, gate_up, down)
    _check_bias(gate_up_bias, gate_up.shape[:2], x)
    _check_bias(down_bias, down.shape[:2], x)
    t, top_k = ids.shape
    e, inter, hidden = gate_up.shape[0], down.shape[2], x.shape[1]
    if t == 0:
        return torch.empty_like(x)
    if ids.device.type == "cpu" and ((ids < 0) | (ids >= e)).any():
        raise ValueError(f"fused_experts: expert ids must lie in [0, {e})")
    x = x if x.stride(1) == 1 else x.contiguous()
    sorted_pairs, block_expert = align(ids, e, tiles.block_m)
    p = t * top_k
    f32 = INTERPRETED or x.dtype == torch.float32
    h = torch.empty((p, inter), dtype=x.dtype, device=x.device)  # [P, I]
    gu_bias = x if gate_up_bias is None else gate_up_bias.contiguous()  # x: a placeholder, never read
    d_bias = x if down_bias is None else down_bias.contiguous()
    _gate_up_kernel[(block_expert.shape[0], triton.cdiv(inter, tiles.block_n))](
        x, gate_up, gu_bias, h, sorted_pairs, block_expert,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), h.stride(0), gu_bias.stride(0),
        act.alpha, act.limit,
        P=p, TOP_K=top_k, H=hidden, INTER=inter, ROW_STEP=2 if act.interleaved else 1,
        UP_OFF=1 if act.interleaved else inter, HAS_BIAS=gate_up_bias is not None, CLAMPED=act.clamped,
        BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k, F32=f32, ROWWISE=INTERPRETED,
    )
    y = torch.empty((p, hidden), dtype=torch.float32, device=x.device)  # [P, H]
    route = weights.reshape(-1).float().contiguous()  # [P]
    _down_kernel[(block_expert.shape[0], triton.cdiv(hidden, tiles.block_n))](
        h, down, d_bias, y, route, sorted_pairs, block_expert,
        h.stride(0), down.stride(0), down.stride(1), down.stride(2), y.stride(0), d_bias.stride(0),
        P=p, H=hidden, INTER=inter, HAS_BIAS=down_bias is not None,
        BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k, F32=f32, ROWWISE=INTERPRETED,
    )
    korder = torch.argsort(ids, dim=1).to(torch.int32).contiguous()  # [T, K]: each token's k by ascending id
    out = torch.empty_like(x)
    _sum_kernel[(t, triton.cdiv(hidden, tiles.block_n))](
        y, out, korder, y.stride(0), out.stride(0), TOP_K=top_k, H=hidden, BN=tiles.block_n,
    )
    return out


def _check_bias(bias: torch.Tensor | None, shape: torch.Size, x: torch.Tensor) -> None:
    if bias is not None and (bias.shape != shape or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(f"fused_experts: a bias must be {list(shape)} in x's dtype and device, got "
                         f"{list(bias.shape)} {bias.dtype}")  # fmt: skip


def _check(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
           down: torch.Tensor) -> None:  # fmt: skip
    if not INTERPRETED and x.device.type != "cuda":
        raise RuntimeError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before import)")
    if x.dim() != 2 or x.dtype not in DTYPES:
        raise ValueError(f"fused_experts: x must be [T, H] in one of {DTYPES}, got {list(x.shape)} {x.dtype}")
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[2] != x.shape[1] or gate_up.shape[1] % 2 \
            or down.shape != (gate_up.shape[0], x.shape[1], gate_up.shape[1] // 2):  # fmt: skip
        raise ValueError(f"fused_experts: gate_up must be [E, 2I, {x.shape[1]}] and down [E, {x.shape[1]}, I], "
                         f"got {list(gate_up.shape)}, {list(down.shape)}")  # fmt: skip
    if gate_up.dtype != x.dtype or down.dtype != x.dtype or gate_up.device != x.device or down.device != x.device:
        raise ValueError("fused_experts: the expert weights must have x's dtype and device")
    if ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[0] != x.shape[0] or ids.device != x.device \
            or weights.shape != ids.shape or weights.device != x.device:  # fmt: skip
        raise ValueError("fused_experts: ids int64 [T, K] and weights [T, K] on x's device")
