"""SamplingParams validation and the sampler's filters and penalties, on synthetic logits."""

from __future__ import annotations

import pytest
import torch

from engine.api.sampling_params import SamplingParams
from engine.sample.sampler import Sampler

from .factories import make_request


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0), ("max_tokens", 1.5), ("temperature", -0.1), ("temperature", float("nan")),
        ("top_p", 0.0), ("top_p", 1.1), ("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("min_tokens", -1), ("logprobs", 21),
        ("logprobs", -1), ("stop", [""]), ("stop_token_ids", [-1]), ("seed", "x"), ("ignore_eos", "yes"),
    ],
)
def test_invalid_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_stop_accepts_a_single_string_and_top_k_minus_one():
    p = SamplingParams(stop="END", top_k=-1)
    assert p.stop == ("END",) and p.top_k == 0


def _req(rid="r", **kw):
    r = make_request(rid, 4)
    r.params = SamplingParams(**kw)
    return r


def test_greedy_takes_argmax_and_reports_raw_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    tokens, lps = Sampler().sample(logits, [_req(temperature=0.0, logprobs=2)])
    assert tokens == [1]
    want = torch.log_softmax(logits[0], -1)
    assert lps[0].logprob == pytest.approx(float(want[1]))
    assert [t for t, _ in lps[0].top] == [1, 3]


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    s = Sampler(seed=0)
    cases = [(dict(top_k=2), {0, 1}), (dict(top_p=0.7), {0, 1}), (dict(min_p=0.5), {0, 1}),
             (dict(top_p=0.5), {0}), (dict(), {0, 1, 2, 3})]
    for kw, allowed in cases:
        seen = set()
        for i in range(400):
            t, _ = s.sample(logits, [_req(f"{kw}-{i}", temperature=1.0, **kw)])
            seen.add(t[0])
        assert seen == allowed, kw


def test_same_seed_same_draws_regardless_of_batch():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    a = [Sampler().sample(logits, [_req("x", temperature=1.0, seed=7)])[0][0] for _ in range(1)]
    batch = torch.cat([torch.randn(3, 64), logits])
    reqs = [_req(f"o{i}", temperature=1.0) for i in range(3)] + [_req("x", temperature=1.0, seed=7)]
    b = Sampler(seed=123).sample(batch, reqs)[0][3]
    assert a[0] == b


def test_draws_follow_the_tempered_distribution():
    # 4000 requests in one batch, each with its own seed: the empirical frequencies match
    # softmax(logits / T) within 4 standard errors, and a zero-probability token is never drawn.
    probs = torch.tensor([0.5, 0.25, 0.0, 0.15, 0.1])
    n, temp = 4000, 0.7
    logits = torch.log(probs).repeat(n, 1)
    reqs = [_req(f"d{i}", temperature=temp, seed=i) for i in range(n)]
    tokens, _ = Sampler().sample(logits, reqs)
    counts = torch.bincount(torch.tensor(tokens), minlength=5).double() / n
    want = torch.softmax(torch.log(probs).double() / temp, -1)
    assert counts[2] == 0
    assert torch.all((counts - want).abs() <= 4 * torch.sqrt(want * (1 - want) / n) + 1e-9), (counts, want)


def test_inverse_cdf_never_lands_past_the_last_token_with_mass():
    from engine.sample.sampler import inverse_cdf

    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    u = torch.tensor([1.0 - 1e-12, 0.0, 0.9999999])  # the first rounds to 1.0 in float32
    assert inverse_cdf(probs, u).tolist() == [1, 3, 0]


def test_repetition_penalty_discourages_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    r = _req(temperature=0.0, repetition_penalty=2.0)
    r.prompt_token_ids = [0]  # token 0 seen: 2.0 -> 1.0, so token 1 wins
    assert Sampler().sample(logits, [r])[0] == [1]


def test_presence_and_frequency_penalties_apply_to_output_tokens():
    logits = torch.tensor([[2.0, 1.5, 0.0]])
    r = _req(temperature=0.0, frequency_penalty=0.3)
    r.output_token_ids = [0, 0]  # 2.0 - 0.6 = 1.4 < 1.5
    assert Sampler().sample(logits, [r])[0] == [1]
    r = _req(temperature=0.0, presence_penalty=0.6)
    r.output_token_ids = [0]
    assert Sampler().sample(logits, [r])[0] == [1]


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[5.0, 0.0, 4.0, 1.0]])  # eos (0) then stop id 2 are the best
    r = _req(temperature=0.0, min_tokens=2, max_tokens=4, stop_token_ids=[2])
    assert Sampler().sample(logits, [r])[0] == [3]
    r.output_token_ids = [3, 3]  # min_tokens reached: eos allowed again
    assert Sampler().sample(logits, [r])[0] == [0]


def test_ignore_eos_with_min_tokens_does_not_mask_eos():
    # eos is not a stop token when ignored, so there is nothing to mask.
    logits = torch.tensor([[5.0, 0.0, 4.0]])
    r = _req(temperature=0.0, min_tokens=2, max_tokens=4, ignore_eos=True)
    assert Sampler().sample(logits, [r])[0] == [0]


# -- numerics at the edges -------------------------------------------------------------------------
def test_tiny_temperatures_are_greedy_and_penalties_are_bounded():
    from engine.api.sampling_params import GREEDY_TEMPERATURE_EPS

    for t in (0.0, 1e-45, 1e-300, GREEDY_TEMPERATURE_EPS / 2):
        assert SamplingParams(temperature=t).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE_EPS).greedy
    for value in (0.0, 1e-300, 1e300, float("inf")):
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=value)
    for field in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: 1e300})
        assert getattr(SamplingParams(**{field: 1e-300}), field) == 1e-300  # tiny but finite: no effect
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=1e308)


def test_a_tiny_temperature_samples_the_argmax_not_nan():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    r = _req(temperature=1e-45, seed=3)
    assert Sampler().sample(logits, [r])[0] == [1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nonfinite_row_gives_no_token_and_leaves_the_others(bad):
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    logits[1] = bad
    if bad != bad:
        logits[1, 1] = 0.0  # NaNs beside a finite value break the row as much as an all-NaN one
    # Plain greedy batch, a greedy row with logprobs, and sampled rows take different paths: all checked.
    for kw in (dict(temperature=0.0), dict(temperature=0.0, logprobs=2), dict(temperature=1.0, seed=1),
               dict(temperature=0.7, top_p=0.5, seed=2)):
        reqs = [_req(f"r{i}", **kw) for i in range(3)]
        tokens, lps = Sampler().sample(logits, reqs)
        assert tokens[1] is None and lps[1] is None, (kw, tokens)
        assert tokens[0] is not None and tokens[2] is not None, (kw, tokens)
        if kw["temperature"] == 0.0:
            assert tokens[0] == 1 and tokens[2] == 2


def test_a_nan_from_the_penalties_gives_no_token():
    # A row whose only finite logit is banned by min_tokens is all -inf after processing.
    logits = torch.tensor([[float("-inf"), 1.0]])
    r = _req(temperature=1.0, min_tokens=1, stop_token_ids=[1], seed=0)
    assert Sampler().sample(logits, [r])[0] == [None]


def test_logit_bias_moves_greedy_and_sampled_choices_but_not_logprobs():
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0], [3.0, 1.0, 0.0, -1.0]])
    reqs = [_req("a", temperature=0.0, logprobs=0, logit_bias={3: 100.0}),
            _req("b", temperature=0.7, seed=1, logit_bias={0: -100.0, 1: -100.0, 3: -100.0})]
    tokens, lps = Sampler().sample(logits, reqs)
    assert tokens == [3, 2]
    raw = torch.log_softmax(logits[0], -1)
    assert lps[0].logprob == pytest.approx(float(raw[3]))  # the model's distribution, before the bias


def test_logit_bias_validation():
    assert SamplingParams(logit_bias={5: 1.0, 2: -3}).logit_bias == ((2, -3), (5, 1.0))
    for bad in ({"x": 1.0}, {1: 101.0}, {-1: 1.0}, {1: float("nan")}, [(1, 1.0), (1, 2.0)]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_logit_bias_tensors_are_built_once_per_request_and_match_the_reference(monkeypatch):
    """A full-vocabulary bias on several rows: its tensors are built on the request's first step and
    reused after (not rebuilt from the pairs each step), and every step's draws equal those of an
    unbiased request (same seed) given logits with the bias added by hand."""
    import engine.sample.sampler as sampler_mod

    builds: list[str] = []
    real_build = sampler_mod._bias_row

    def counting(r, vocab, device):
        if r.bias is None:
            builds.append(r.request_id)
        return real_build(r, vocab, device)

    monkeypatch.setattr(sampler_mod, "_bias_row", counting)
    vocab, rows, steps = 512, 4, 6
    gen = torch.Generator().manual_seed(0)
    dense = (torch.rand(rows, vocab, generator=gen) * 8 - 4).round(decimals=2)  # one bias per token, per row
    bias = [{t: float(dense[i, t]) for t in range(vocab)} for i in range(rows)]
    bias[2] = {t: float(dense[2, t]) for t in range(0, vocab, 5)}  # a bias on every 5th token only
    dense[2] = torch.zeros(vocab).index_put_((torch.arange(0, vocab, 5),), dense[2, ::5])
    kinds = [dict(temperature=0.0), dict(temperature=0.9, seed=7), dict(temperature=0.8, seed=8, top_k=50),
             dict(temperature=0.0, repetition_penalty=1.3)]
    biased = [_req(f"b{i}", logit_bias=bias[i], **kinds[i]) for i in range(rows)]
    plain = [_req(f"p{i}", **{k: v for k, v in kinds[i].items() if k != "repetition_penalty"}) for i in range(rows)]
    s_biased, s_plain = Sampler(), Sampler()
    for step in range(steps):
        logits = torch.randn(rows, vocab, generator=gen)
        got, _ = s_biased.sample(logits, biased)
        # The reference: the penalty by hand first (on the raw logits), then the dense bias.
        ref_logits = logits.clone()
        for i in range(rows):
            sampler_mod._penalise_row(ref_logits[i], biased[i])
        want, _ = s_plain._sample(ref_logits + dense, logits, plain)
        assert got == want, f"step {step}"
        for r, t in zip(biased + plain, got + want, strict=True):
            r.output_token_ids.append(t)
    assert sorted(builds) == [f"b{i}" for i in range(rows)]  # once each, not once per step
    assert all(torch.equal(r.bias, dense[i]) and r.bias.dtype == torch.float32 for i, r in enumerate(biased))
    # The batch's bias matrix is rebuilt only when the biased rows change: here, never after step 0.
    matrix = s_biased._bias_batch[2]
    s_biased.sample(torch.randn(rows, vocab, generator=gen), biased)
    assert s_biased._bias_batch[2] is matrix
    s_biased.sample(torch.randn(rows - 1, vocab, generator=gen), biased[1:])  # another batch: rebuilt
    assert s_biased._bias_batch[2] is not matrix and len(builds) == rows


def test_with_seed_copies_everything_but_the_seed_and_checks_it():
    p = SamplingParams(temperature=0.7, seed=1, logit_bias={t: 1.0 for t in range(1000)}, stop=["x"])
    q = p.with_seed(5)
    assert q.seed == 5 and p.seed == 1 and q.logit_bias is p.logit_bias and q.stop == p.stop
    with pytest.raises(ValueError, match="seed"):
        p.with_seed(2**64)


def test_logit_bias_on_rows_apart_matches_rows_together():
    """Biased rows that are not adjacent in the batch (index_put_) get what adjacent ones (slice add) get."""
    vocab = 64
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1))
    bias = {t: (t % 5 - 2) * 3.0 for t in range(vocab)}
    apart = [_req(f"r{i}", temperature=0.0, logit_bias=bias if i in (0, 2, 4) else {}) for i in range(5)]
    tokens, _ = Sampler().sample(logits, apart)
    dense = torch.tensor([bias[t] for t in range(vocab)])
    want = [int((logits[i] + (dense if i in (0, 2, 4) else 0)).argmax()) for i in range(5)]
    assert tokens == want
