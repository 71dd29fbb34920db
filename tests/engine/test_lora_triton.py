"""The Triton LoRA delta (engine/lora/triton_lora.py) against float64 math of the per-segment
formula, run on the CPU by the Triton interpreter: base-model rows, adapters of different ranks, one
that does not target the linear, rows of one adapter scattered through the step, 1 to 40 rows,
feature counts that are not powers of two, float32 / bfloat16 / float16; strided inputs and
outputs; refused operands; and which path LayerLora.add takes on which device."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or the kernels are imported: kernels take CPU tensors

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from engine.lora import batch as lora_batch  # noqa: E402
from engine.lora import triton_lora as TL  # noqa: E402
from engine.lora.batch import build_batch, delta_path  # noqa: E402

if not TL.INTERPRETED:  # imported earlier in this process without the interpreter: decorate again
    TL = importlib.reload(TL)

IN, OUT = 40, 56  # neither a power of two: partial tiles on both sides
TILES = TL.LoraTiles(block_r=8, block_k=16, block_n=16)  # small: several tiles of every kind
RANKS = (3, 8, 13)  # the largest spans two rank tiles


def _operands(dtype: torch.dtype, g: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Segments 0-2: adapters of RANKS; segment 3: an adapter that does not target this linear."""
    a_list = [(torch.randn(r, IN, generator=g) / IN**0.5).to(dtype) for r in RANKS] + [torch.empty(0)]
    bt_list = [torch.randn(r, OUT, generator=g).to(dtype) for r in RANKS] + [torch.empty(0)]
    return a_list, bt_list


def _reference(y, x, a_list, bt_list, slots) -> torch.Tensor:
    """y + the per-segment delta, in float64 on the same (rounded) operands."""
    want = y.double()
    for s, (a, bt) in enumerate(zip(a_list, bt_list, strict=True)):
        rows = (slots == s).nonzero().flatten()
        if a.numel() and len(rows):
            want[rows] += (x.double()[rows] @ a.double().t()) @ bt.double()
    return want


def _slots(rows: int, g: torch.Generator) -> torch.Tensor:
    """Every segment and the base model (-1) once where rows allow, the rest at random, shuffled."""
    fixed = torch.tensor([0, -1, 1, 2, 3])[:rows]
    rest = torch.randint(-1, 4, (rows - len(fixed),), generator=g)
    return torch.cat([fixed, rest])[torch.randperm(rows, generator=g)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_kernels_run_under_the_interpreter():
    # The point of this module: these are interpreter functions, so the kernels below really run.
    assert TL.INTERPRETED
    assert type(TL._shrink_kernel).__name__ == "InterpretedFunction"


# ---- the delta against float64 --------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 5, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_equals_float64_per_segment(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    a_list, bt_list = _operands(dtype, g)
    slots = _slots(rows, g)
    x = torch.randn(rows, IN, generator=g).to(dtype)
    y = torch.randn(rows, OUT, generator=g).to(dtype)
    y[:, 0] = -0.0  # y + 0 would make it +0.0: rows without a delta must not be written at all
    got = y.clone()
    TL.lora_add_triton(got, x, a_list, bt_list, slots, TILES)
    want = _reference(y, x, a_list, bt_list, slots)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:  # float32 sums, one rounding to bf16 (the interpreter truncates: up to one ulp, 2**-7 relative)
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-3)
    skipped = (slots < 0) | (slots == 3)  # base-model rows and the adapter that does not target the linear
    assert torch.equal(_bits(got[skipped]), _bits(y[skipped]))
    adapted = ~skipped
    assert (got[adapted] != y[adapted]).any(dim=1).all()  # every adapted row got its delta


def test_float16_and_the_largest_rank_alone():
    g = torch.Generator().manual_seed(7)
    a_list, bt_list = _operands(torch.float16, g)
    slots = torch.tensor([2, 2, -1, 2, 2, 2])  # only the rank-13 adapter: both rank tiles of the shrink
    x = torch.randn(6, IN, generator=g).half()
    y = torch.randn(6, OUT, generator=g).half()
    got = y.clone()
    TL.lora_add_triton(got, x, a_list, bt_list, slots, TILES)
    torch.testing.assert_close(got.double(), _reference(y, x, a_list, bt_list, slots), rtol=2**-10, atol=1e-3)


def test_default_tiles_cover_one_tile_shapes():
    # the serving tiles: every rank, input and output in one tile
    g = torch.Generator().manual_seed(3)
    a_list, bt_list = _operands(torch.float32, g)
    slots = _slots(9, g)
    x, y = torch.randn(9, IN, generator=g), torch.randn(9, OUT, generator=g)
    got = y.clone()
    TL.lora_add_triton(got, x, a_list, bt_list, slots)
    torch.testing.assert_close(got.double(), _reference(y, x, a_list, bt_list, slots), rtol=1e-5, atol=1e-5)


def test_strided_input_and_output():
    g = torch.Generator().manual_seed(5)
    a_list, bt_list = _operands(torch.float32, g)
    slots = _slots(12, g)
    x = torch.randn(12, 2 * IN, generator=g)[:, IN:]  # rows strided, as a split of a fused product
    wide = torch.randn(12, OUT + 8, generator=g)
    y = wide[:, 8:]
    before = wide.clone()
    TL.lora_add_triton(y, x, a_list, bt_list, slots, TILES)
    torch.testing.assert_close(wide[:, 8:].double(), _reference(before[:, 8:], x, a_list, bt_list, slots),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    assert torch.equal(wide[:, :8], before[:, :8])  # the rest of the fused output is untouched

    column_major = torch.randn(OUT, 12, generator=g).t()  # no unit column stride: copied, written back
    before = column_major.clone()
    TL.lora_add_triton(column_major, x, a_list, bt_list, slots, TILES)
    torch.testing.assert_close(column_major.double(), _reference(before, x, a_list, bt_list, slots),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_nothing_to_add_leaves_y_alone():
    x, y = torch.randn(4, IN), torch.randn(4, OUT)
    got = y.clone()
    TL.lora_add_triton(got, x, [torch.empty(0)], [torch.empty(0)], torch.tensor([0, -1, 0, 0]), TILES)
    assert torch.equal(got, y)
    TL.lora_add_triton(got[:0], x[:0], [torch.randn(4, IN)], [torch.randn(4, OUT)],
                       torch.empty(0, dtype=torch.long), TILES)  # fmt: skip


def test_refuses_bad_operands():
    x, y = torch.randn(2, IN), torch.randn(2, OUT)
    a, bt = torch.randn(4, IN), torch.randn(4, OUT)
    ok = torch.tensor([0, -1])
    with pytest.raises(ValueError, match="slots must lie"):
        TL.lora_add_triton(y, x, [a], [bt], torch.tensor([0, 1]), TILES)
    with pytest.raises(ValueError, match="with A's rank"):
        TL.lora_add_triton(y, x, [a], [torch.randn(3, OUT)], ok, TILES)
    with pytest.raises(ValueError, match="A must be contiguous"):
        TL.lora_add_triton(y, x, [a.bfloat16()], [bt], ok, TILES)
    with pytest.raises(ValueError, match="A must be contiguous"):
        TL.lora_add_triton(y, x, [torch.randn(IN, 4).t()], [bt], ok, TILES)
    with pytest.raises(ValueError, match="one A and one B"):
        TL.lora_add_triton(y, x, [a], [], ok, TILES)
    with pytest.raises(ValueError, match="share T"):
        TL.lora_add_triton(y[:1], x, [a], [bt], ok, TILES)
    with pytest.raises(ValueError, match="int64"):
        TL.lora_add_triton(y, x, [a], [bt], ok.int(), TILES)
    with pytest.raises(ValueError, match="one device"):
        TL.lora_add_triton(y.double(), x.double(), [a], [bt], ok, TILES)


# ---- LayerLora.add --------------------------------------------------------------------------------


def test_delta_path_picks_triton_on_cuda():
    assert delta_path("cuda", torch.bfloat16, False, True) == "triton"
    assert delta_path("cuda", torch.float16, False, True) == "triton"
    assert delta_path("cuda", torch.float32, True, True) == "triton"
    assert delta_path("cuda", torch.bfloat16, False, False) == "torch"  # no triton: PyTorch products
    assert delta_path("cuda", torch.float64, False, True) == "torch"  # a dtype the kernels do not take
    assert lora_batch.TRITON_DTYPES == TL.DTYPES
    assert delta_path("cpu", torch.float32, True, True) == "cpp"  # the C++ kernel stays the CPU's float32 path
    assert delta_path("cpu", torch.float32, False, True) == "torch"
    assert delta_path("cpu", torch.bfloat16, True, True) == "cpp"  # bf16 rows too
    assert delta_path("cpu", torch.float16, True, True) == "torch"  # never the interpreter in serving


def test_layer_add_on_the_triton_path_equals_the_pytorch_path(monkeypatch):
    g = torch.Generator().manual_seed(11)
    a_list, bt_list = _operands(torch.float32, g)
    pairs = [[{"m": (a, bt)}] if a.numel() else [{}] for a, bt in zip(a_list, bt_list, strict=True)]
    # packed runs (rows, lora_id, pairs): adapter 1 in two places, base rows between, one not targeting "m"
    runs = [(3, 1, pairs[0]), (2, 0, None), (1, 2, pairs[2]), (4, 1, pairs[0]), (2, 3, pairs[3]), (2, 4, pairs[1])]
    batch = build_batch(runs, torch.device("cpu"))
    x, y = torch.randn(14, IN, generator=g), torch.randn(14, OUT, generator=g)
    layer = batch.layer(0)
    calls = []
    real = TL.lora_add_triton
    monkeypatch.setattr(TL, "lora_add_triton", lambda *args: calls.append(1) or real(*args, TILES))
    monkeypatch.setattr(lora_batch, "delta_path", lambda *args: "triton")
    got = layer.add("m", x, y.clone())
    assert calls == [1]
    monkeypatch.setattr(lora_batch, "delta_path", lambda *args: "torch")
    want = layer.add("m", x, y.clone())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    unchanged = [3, 4, 10, 11]  # base-model rows and the adapter that does not target "m"
    assert torch.equal(got[unchanged], y[unchanged])
    assert not torch.equal(got[0], y[0])


def test_triton_ready_follows_the_probe(monkeypatch, caplog):
    import engine.attention as attention

    cuda = torch.device("cuda", 0)  # never touched: the probe is replaced
    try:
        monkeypatch.setattr(attention, "triton_unavailable_reason", lambda device: "no C compiler")
        lora_batch.triton_ready.cache_clear()
        assert not lora_batch.triton_ready(cuda)
        assert "no C compiler" in caplog.text
        monkeypatch.setattr(attention, "triton_unavailable_reason", lambda device: None)
        assert not lora_batch.triton_ready(cuda)  # asked once per device and process
        lora_batch.triton_ready.cache_clear()
        assert lora_batch.triton_ready(cuda)
    finally:
        lora_batch.triton_ready.cache_clear()
