"""The C++ row sampler (engine/kernels/csrc/cpu_sampling.cpp, torch.ops.tokenmill.sample_rows) against a float64
reference over odd vocabularies and 1..64 rows, and the Sampler wired to it: the same draws as the
PyTorch path from the same seeds, batch-independent, non-finite rows failed alone."""

from __future__ import annotations

import pytest
import torch

from engine.api.sampling_params import SamplingParams
from engine.sample.sampler import Sampler

from .factories import make_request
from .helpers import require_cpu_kernels

require_cpu_kernels()


def _reference(logits: torch.Tensor, inv_t: torch.Tensor, u: torch.Tensor):
    """float64: the drawn index for each row, its probability, and the distance of u x total to the
    nearest CDF boundary (a draw that close may round either way)."""
    x = logits.double() * inv_t.double()[:, None]
    probs = torch.softmax(x, dim=-1)
    cdf = probs.cumsum(-1)
    target = u.double()[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).clamp(max=logits.shape[1] - 1)[:, 0]
    margin = (cdf - target).abs().min(dim=-1).values
    return idx, probs.gather(1, idx[:, None])[:, 0], margin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab", [(1, 1), (1, 5), (7, 1000), (64, 49157), (3, 65), (5, 64)])
def test_draws_match_a_float64_reference(rows, vocab, dtype):
    g = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    inv_t = 1.0 / (0.2 + torch.rand(rows, generator=g) * 1.5)
    u = torch.rand(rows, generator=g)
    tokens, probs = torch.ops.tokenmill.sample_rows(logits, inv_t, u)
    want, want_p, margin = _reference(logits.float(), inv_t, u)
    clear = margin > 1e-5  # u lands away from a boundary: the index is determined
    assert torch.equal(tokens[clear], want[clear])
    assert clear.float().mean() > 0.9  # the test sees real draws, not only boundary cases
    torch.testing.assert_close(probs[clear].double(), want_p[clear], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_take_the_first_maximum(dtype):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 301, generator=g).to(dtype)
    logits[4, [17, 200]] = 50.0  # a tie: the first index, as torch.argmax
    tokens, scores = torch.ops.tokenmill.sample_rows(logits, torch.zeros(9), torch.rand(9, generator=g))
    assert torch.equal(tokens, logits.float().argmax(-1)) and tokens[4] == 17
    assert torch.equal(scores, logits.float().max(-1).values)


def test_zero_probability_tokens_are_never_drawn():
    logits = torch.full((4, 130), float("-inf"))
    logits[:, [0, 64, 129]] = torch.tensor([1.0, 2.0, 0.5])  # mass in three chunks, the rest none
    u = torch.tensor([0.0, 0.5, 1.0 - 2**-24, 0.9999999])
    tokens, probs = torch.ops.tokenmill.sample_rows(logits, torch.ones(4), u)
    assert set(tokens.tolist()) <= {0, 64, 129} and tokens[0] == 0 and tokens[2] == 129
    assert torch.all(probs > 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_row_scores_nan_and_leaves_the_others(bad):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = bad
    tokens, probs = torch.ops.tokenmill.sample_rows(logits, torch.ones(3), torch.full((3,), 0.5))
    assert torch.isnan(probs[1]) and torch.isfinite(probs[[0, 2]]).all()
    want, _, _ = _reference(logits[[0, 2]], torch.ones(2), torch.full((2,), 0.5))
    assert torch.equal(tokens[[0, 2]], want)
    greedy_scores = torch.ops.tokenmill.sample_rows(logits, torch.zeros(3), torch.zeros(3))[1]
    assert not torch.isfinite(greedy_scores[1])  # NaN or +inf: the engine fails the row either way


def _req(rid, **kw):
    r = make_request(rid, 4)
    r.params = SamplingParams(**kw)
    return r


def _mixed(n: int):
    """Greedy, seeded sampled, and top-p rows (the last take the PyTorch path)."""
    kinds = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=1.0, top_p=0.9)]
    return [_req(f"m{i}", seed=i, **kinds[i % 3]) for i in range(n)]


def test_the_kernel_draws_what_the_pytorch_path_draws_from_the_same_seeds():
    logits = (torch.randn(48, 4096, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    fast = Sampler(rows_kernel=True).sample(logits, _mixed(48))[0]
    slow = Sampler(rows_kernel=False).sample(logits, _mixed(48))[0]
    assert fast == slow


def test_a_seeded_row_draws_the_same_in_any_batch_with_the_kernel():
    g = torch.Generator().manual_seed(2)
    row = torch.randn(1, 4096, generator=g) * 3
    alone = Sampler(rows_kernel=True).sample(row, [_req("x", temperature=0.9, seed=5)])[0]
    batch = torch.cat([torch.randn(5, 4096, generator=g), row])
    reqs = [*_mixed(5), _req("x", temperature=0.9, seed=5)]
    assert Sampler(seed=9, rows_kernel=True).sample(batch, reqs)[0][5] == alone[0]
