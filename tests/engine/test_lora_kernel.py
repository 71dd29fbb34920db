"""The LoRA delta (float32 or bf16 rows; float32 pairs, or bf16 ones with bf16 rows) in one C++ call per linear (tokenmill::lora_add_, engine/lora/batch.py)
against the per-segment PyTorch form: mixed segments, base-model rows, an adapter that does not
target the module, refused operands. The end-to-end parity with peft (tests/engine/test_lora.py) runs
through it in float32."""

from __future__ import annotations

import pytest
import torch

from engine.lora import batch as lora_batch
from engine.lora.batch import build_batch

from .helpers import require_cpu_kernels

require_cpu_kernels()

IN, OUT = 40, 56


def _pairs(rank: int, g: torch.Generator) -> list[dict]:
    return [{"m": (torch.randn(rank, IN, generator=g), torch.randn(rank, OUT, generator=g))}]


def test_kernel_equals_the_pytorch_form(monkeypatch):
    g = torch.Generator().manual_seed(0)
    a4, a8, untargeted = _pairs(4, g), _pairs(8, g), [{}]
    # packed runs (rows, lora_id, pairs): adapter 1 in two places, base rows between, one adapter without "m"
    runs = [(3, 1, a4), (2, 0, None), (1, 2, a8), (4, 1, a4), (2, 3, untargeted)]
    batch = build_batch(runs, torch.device("cpu"))
    assert batch.slots.tolist() == [0, 0, 0, -1, -1, 1, 0, 0, 0, 0, 2, 2]
    x, y = torch.randn(12, IN, generator=g), torch.randn(12, OUT, generator=g)
    layer = batch.layer(0)
    got = layer.add("m", x, y.clone())
    monkeypatch.setattr(lora_batch, "kernel_available", lambda: False)
    want = layer.add("m", x, y.clone())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    unchanged = [3, 4, 10, 11]  # base-model rows and the adapter that does not target "m"
    assert torch.equal(got[unchanged], y[unchanged])
    assert not torch.equal(got[0], y[0])


def test_kernel_takes_a_non_contiguous_output():
    g = torch.Generator().manual_seed(1)
    batch = build_batch([(5, 1, _pairs(4, g))], torch.device("cpu"))
    x = torch.randn(5, IN, generator=g)
    wide = torch.randn(5, 2 * OUT, generator=g)
    y = wide[:, :OUT]  # a view, as a fused product's split gives
    before = y.clone()
    a, bt = batch.segments[0].layers[0]["m"]
    batch.layer(0).add("m", x, y)
    torch.testing.assert_close(wide[:, :OUT], before + (x @ a.t()) @ bt, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_bad_operands():
    op = torch.ops.tokenmill.lora_add_
    x, y = torch.randn(2, IN), torch.randn(2, OUT)
    a, bt = torch.randn(4, IN), torch.randn(4, OUT)
    with pytest.raises(RuntimeError, match="out of range"):
        op(y, x, [a], [bt], torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="with A's rank"):
        op(y, x, [a], [torch.randn(3, OUT)], torch.tensor([0, 0]))
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        op(y.half(), x.half(), [a], [bt], torch.tensor([0, 0]))
    with pytest.raises(RuntimeError, match="of x's dtype"):
        op(y, x.bfloat16(), [a], [bt], torch.tensor([0, 0]))


@pytest.mark.parametrize("pairs", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [4, 5, 17])
def test_bf16_rows_get_the_float32_delta_rounded_once(pairs, rank):
    """bf16 x and y with float32 or bf16 pairs: each row's delta is summed in float32 on the widened
    operands and added to y's row in float32, one rounding to bf16 at the end (a few rows and ranks
    that are not multiples of the tiles, so the short groups run too); base rows are left alone."""
    g = torch.Generator().manual_seed(2)
    a, bt = torch.randn(rank, IN, generator=g).to(pairs), torch.randn(rank, OUT, generator=g).to(pairs)
    batch = build_batch([(6, 1, [{"m": (a, bt)}]), (2, 0, None)], torch.device("cpu"))
    x = torch.randn(8, IN, generator=g).bfloat16()
    y = torch.randn(8, OUT, generator=g).bfloat16()
    got = batch.layer(0).add("m", x, y.clone())
    want = (y[:6].double() + (x[:6].double() @ a.double().t()) @ bt.double())
    assert got.dtype == torch.bfloat16
    # one rounding of a float32 sum: within a bf16 half-ulp of the exact value (plus float32 noise)
    assert ((got[:6].double() - want).abs() <= want.abs() * 2**-8 + 1e-5).all()
    assert torch.equal(got[6:], y[6:])


def test_mixed_pair_dtypes_are_refused():
    op = torch.ops.tokenmill.lora_add_
    x, y = torch.randn(2, IN).bfloat16(), torch.randn(2, OUT).bfloat16()
    a, bt = torch.randn(4, IN), torch.randn(4, OUT)
    with pytest.raises(RuntimeError, match="one dtype for every adapter"):
        op(y, x, [a, a.bfloat16()], [bt, bt.bfloat16()], torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="or bf16 with bf16 rows"):
        op(y.float(), x.float(), [a.bfloat16()], [bt.bfloat16()], torch.tensor([0, 0]))


def _reference(y, x, a, bt, slots, spans):
    """y + each row's delta in float64, only within its adapter's spans (rows (c0, c1, r0, r1))."""
    want = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s < 0 or a[s].numel() == 0:
            continue
        tmp = x[t].double() @ a[s].double().t()
        for c0, c1, r0, r1 in spans[s].tolist():
            want[t, c0:c1] += tmp[r0:r1] @ bt[s].double()[r0:r1, c0:c1]
    return want


# (in, out, ranks, rows per adapter): `in` a multiple of 32 takes the AMX path on AMX CPUs where an
# adapter has 4+ rows on average (groups of 16 rows: 17 and 20 make two); 40 never does (AVX-512)
CASES = [(64, 48, [4, 16, 17, 40], 8), (576, 960, [48, 16], 8), (64, 80, [8, 24], 1), (96, 30, [70], 20),
         (40, 56, [16, 5], 6), (32, 16, [16, 16, 16], 17)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_spans_are_all_the_kernel_reads(dtype, case):
    """Each adapter's B^T non-zero everywhere, but only its spans (two per adapter, one with an odd
    start rank, columns not multiples of 16) count: every path (the AMX tiles for bf16 where they run,
    with the pair packed once or on the fly; AVX-512 register tiles; float32) adds exactly those
    blocks' products, within one rounding of float32 sums; base rows untouched."""
    in_f, out_f, ranks, per = case
    g = torch.Generator().manual_seed(in_f + out_f + per)
    a = [torch.randn(r, in_f, generator=g).to(dtype) for r in ranks]
    bt = [torch.randn(r, out_f, generator=g).to(dtype) for r in ranks]
    spans = []
    for r in ranks:
        c, q = out_f // 3 + 1, max(1, r // 2) | 1
        spans.append(torch.tensor([[0, c, 0, q], [c + 2, out_f, q, r]], dtype=torch.long))
    slots = torch.tensor([s for s in range(len(ranks)) for _ in range(per)] + [-1, -1])
    slots = slots[torch.randperm(len(slots), generator=g)]
    x = torch.randn(len(slots), in_f, generator=g).to(dtype)
    y = torch.randn(len(slots), out_f, generator=g).to(dtype)
    want = _reference(y, x, a, bt, slots, spans)
    op = torch.ops.tokenmill.lora_add_
    got = y.clone()
    op(got, x, a, bt, slots, spans)
    bound = want.abs() * (2**-8 if dtype == torch.bfloat16 else 1e-6) + 1e-4
    assert ((got.double() - want).abs() <= bound).all()
    assert torch.equal(got[slots < 0], y[slots < 0])
    if dtype == torch.bfloat16 and in_f % 32 == 0:  # the pair in its tile layouts, made once: the same bits
        packed = [torch.ops.tokenmill.lora_pack_bf16(ai, bi, si) for ai, bi, si in zip(a, bt, spans, strict=True)]
        again = y.clone()
        op(again, x, a, bt, slots, spans, packed)
        assert torch.equal(again, got)


def test_bad_spans_and_packed_pairs_are_refused():
    op = torch.ops.tokenmill.lora_add_
    x, y = torch.randn(2, 64).bfloat16(), torch.randn(2, 48).bfloat16()
    a, bt = torch.randn(4, 64).bfloat16(), torch.randn(4, 48).bfloat16()
    slots = torch.tensor([0, 0])
    with pytest.raises(RuntimeError, match="outside B"):
        op(y, x, [a], [bt], slots, [torch.tensor([[0, 49, 0, 4]])])
    with pytest.raises(RuntimeError, match="outside B"):
        op(y, x, [a], [bt], slots, [torch.tensor([[0, 48, 0, 5]])])
    with pytest.raises(RuntimeError, match="without overlap"):
        op(y, x, [a], [bt], slots, [torch.tensor([[0, 30, 0, 2], [20, 48, 2, 4]])])
    with pytest.raises(RuntimeError, match="int64 \\[S, 4\\]"):
        op(y, x, [a], [bt], slots, [torch.tensor([0, 48, 0, 4])])
    with pytest.raises(RuntimeError, match="lora_pack_bf16's bf16 vector"):
        op(y, x, [a], [bt], slots, None, [torch.zeros(7, dtype=torch.bfloat16)])
    with pytest.raises(RuntimeError, match="in a multiple of 32"):
        torch.ops.tokenmill.lora_pack_bf16(torch.randn(4, 40).bfloat16(), torch.randn(4, 48).bfloat16(), torch.empty(0))


def test_the_decode_loops_adapter_set_is_checked_once_when_made():
    """The C++ loop's set of adapters (cpu_decode.cpp LoraSet: each linear's operands checked and laid
    out when made, not per call) refuses what lora_add_ refuses, naming it, and lists that do not cover
    every layer, linear and segment."""
    make = torch.classes.tokenmill.LoraSet
    a, bt = torch.randn(4, 64).bfloat16(), torch.randn(4, 48).bfloat16()
    spans, none = torch.tensor([[0, 48, 0, 4]]), torch.empty(0, dtype=torch.bfloat16)
    good = make([a] * 4, [bt] * 4, [spans] * 4, [none] * 4, 1)  # one layer's four linears, one segment
    assert good is not None
    with pytest.raises(RuntimeError, match="every layer, linear and segment"):
        make([a] * 3, [bt] * 3, [spans] * 3, [none] * 3, 1)
    with pytest.raises(RuntimeError, match="every layer, linear and segment"):
        make([a] * 4, [bt] * 4, [spans] * 4, [none] * 4, 0)
    with pytest.raises(RuntimeError, match="is outside B"):
        make([a] * 4, [bt] * 4, [torch.tensor([[0, 49, 0, 4]])] * 4, [none] * 4, 1)
    with pytest.raises(RuntimeError, match="one dtype for every adapter"):
        make([a, a.float()] * 4, [bt, bt.float()] * 4, [spans] * 8, [none] * 8, 2)
    with pytest.raises(RuntimeError, match="with A's rank"):
        make([a] * 4, [bt[:3]] * 4, [spans] * 4, [none] * 4, 1)


def test_placed_adapters_carry_their_spans_and_tile_layouts():
    """A fused module's pair knows its block-diagonal spans (q/k/v side by side), and placed in bf16 on
    a CPU whose deltas run on the tile unit it carries its packed copy (else none)."""
    from engine.lora.adapter import Pair, _placed

    a = torch.randn(8, 64)
    b = torch.zeros(48, 8)
    b[:32, :4], b[32:, 4:] = torch.randn(32, 4), torch.randn(16, 4)
    pair = Pair(a, b, torch.tensor([[0, 32, 0, 4], [32, 48, 4, 8]]))
    placed = _placed(pair, torch.device("cpu"), torch.bfloat16)
    pa, pbt = placed
    assert pbt.shape == (8, 48) and torch.equal(placed.spans, pair.spans)
    assert (placed.packed is not None) == lora_batch.tile_unit()
    assert _placed(pair, torch.device("cpu"), torch.float32).packed is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_delta_does_not_depend_on_its_neighbours(dtype):
    """The batch-invariant mode's contract for the delta: the same rows (on two adapters) give the same
    bits alone, beside base rows, beside many rows of other adapters, and inside a prompt-sized call of
    200 rows, whatever path (tile unit, register tiles) and thread split each call takes; the rows
    cancel, so a sum taken in another order would show (checked: choosing the path by rows per adapter
    fails this)."""
    g = torch.Generator().manual_seed(11)
    in_f, out_f, ranks = 128, 960, [16, 8, 48]
    a = [(torch.randn(r, in_f, generator=g) / in_f**0.5).to(dtype) for r in ranks]
    bt = [torch.randn(r, out_f, generator=g).to(dtype) for r in ranks]
    spans = [torch.tensor([[0, 500, 0, r // 2], [500, out_f, r // 2, r]]) for r in ranks]
    # cancelling rows (+-2^24 among ones, A of +-1): any change in a sum's order changes its bits
    mine_x = torch.ones(3, in_f)
    for k in range(3):
        cols = torch.randperm(in_f, generator=g)[:4]
        mine_x[k, cols] = torch.tensor([2.0**24, -(2.0**24), 2.0**23, -(2.0**23)])
    mine_x = mine_x.to(dtype)
    a[0] = torch.randint(0, 2, (ranks[0], in_f), generator=g).mul(2).sub(1).to(dtype)
    a[1] = torch.randint(0, 2, (ranks[1], in_f), generator=g).mul(2).sub(1).to(dtype)
    mine_y = torch.randn(3, out_f, generator=g).to(dtype)
    mine_slots = [0, 1, 0]
    op = torch.ops.tokenmill.lora_add_

    def run(n_others: int, other_slots: list[int]) -> torch.Tensor:
        x = torch.cat([torch.randn(n_others, in_f, generator=g).to(dtype), mine_x])
        y = torch.cat([torch.randn(n_others, out_f, generator=g).to(dtype), mine_y])
        slots = torch.tensor([other_slots[i % len(other_slots)] for i in range(n_others)] + mine_slots)
        perm = torch.randperm(len(slots), generator=g)
        x, y, slots = x[perm].contiguous(), y[perm].contiguous(), slots[perm].contiguous()
        op(y, x, a, bt, slots, spans)
        where = [int((perm == n_others + k).nonzero()) for k in range(3)]
        return y[where]

    alone = run(0, [0])
    for n_others, other_slots in [(1, [-1]), (5, [2]), (29, [0, 1, 2, -1]), (197, [2, 2, 0, -1])]:
        assert torch.equal(run(n_others, other_slots), alone), (n_others, other_slots)


def _random_call(g: torch.Generator, dtype: torch.dtype, in_f: int, out_f: int, ranks: list[int], slots: list[int]):
    a = [(torch.randn(r, in_f, generator=g) / in_f**0.5).to(dtype) for r in ranks]
    bt = [torch.randn(r, out_f, generator=g).to(dtype) for r in ranks]
    spans = [torch.tensor([[0, out_f // 2, 0, r // 2], [out_f // 2, out_f, r // 2, r]]) for r in ranks]
    x = torch.randn(len(slots), in_f, generator=g).to(dtype)
    y = torch.randn(len(slots), out_f, generator=g).to(dtype)
    return y, x, a, bt, torch.tensor(slots), spans


# (ranks, slots): 4 adapters of 8 rows (2 threads take whole groups of rows, 3 share the columns), one
# adapter of 12 rows (the threads share its columns), 3 groups (the same), 4 groups of 1-16 rows,
# base rows among them
SPLITS = [([16, 16, 16, 16], [s for s in range(4) for _ in range(8)]), ([16], [0] * 12 + [-1] * 3),
          ([32, 16, 8], [0] * 12 + [1] * 5 + [2] * 3 + [-1]), ([32, 16, 8], [0] * 20 + [1] * 5 + [2] + [-1]),
          ([16, 48], [1, 0, -1, 1, 1, 0])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", SPLITS)
def test_the_delta_is_the_same_on_any_number_of_threads(dtype, case):
    """Whether the threads split a call by groups of rows or by columns (and one thread does it all),
    each output gets the same bits: every path sums a row's delta in its own fixed order."""
    ranks, slots = case
    g = torch.Generator().manual_seed(len(slots))
    y, x, a, bt, slots_t, spans = _random_call(g, dtype, 576, 960, ranks, slots)
    before = torch.get_num_threads()
    got = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = y.clone()
            torch.ops.tokenmill.lora_add_(out, x, a, bt, slots_t, spans)
            got.append(out)
    finally:
        torch.set_num_threads(before)
    assert not torch.equal(got[0], y)
    assert torch.equal(got[1], got[0]) and torch.equal(got[2], got[0])


def test_a_call_after_a_bigger_one_is_unchanged_by_it():
    """The kernel keeps its per-call lists across calls (a decode step makes 120): a small call gives the
    same bits before and after a call with more adapters, ranks, rows and spans, and matches the
    float64 reference."""
    g = torch.Generator().manual_seed(5)
    op = torch.ops.tokenmill.lora_add_
    small = _random_call(g, torch.bfloat16, 64, 96, [8, 4], [1, -1, 0, 1])
    big = _random_call(g, torch.bfloat16, 128, 200, [48, 16, 16, 32, 8], [s % 5 for s in range(40)] + [-1])
    first = small[0].clone()
    op(first, *small[1:])
    op(big[0].clone(), *big[1:])
    again = small[0].clone()
    op(again, *small[1:])
    assert torch.equal(again, first)
    y, x, a, bt, slots, spans = small
    want = _reference(y, x, a, bt, slots, spans)
    assert ((first.double() - want).abs() <= want.abs() * 2**-8 + 1e-4).all()
