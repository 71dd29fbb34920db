"""Load-test statistics on hand-made requests with known timestamps: exact percentiles, TTFT, ITL,
TPOT, goodput, counts by status, and knee detection on synthetic curves."""

from __future__ import annotations

import pytest

from bench.lib.stats import RequestRecord, Slo, distribution, find_knee, percentile, summarize


def rec(sent: float, tokens: list[float], done: float | None = None, status: str = "ok", **kw) -> RequestRecord:
    return RequestRecord(sent_at=sent, status=status, token_times=tokens,
                         done_at=done if done is not None else (tokens[-1] if tokens else sent), **kw)


def test_percentile_interpolates_linearly_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 x (4 - 3)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert percentile(list(range(101)), 37) == pytest.approx(37)
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_mean_and_percentiles():
    d = distribution([1.0, 2.0, 3.0, 4.0, 10.0])
    assert d == pytest.approx({"mean": 4.0, "p50": 3.0, "p90": 7.6, "p99": 9.76})
    assert distribution([]) is None


def test_request_ttft_itl_tpot_e2e():
    # sent at 10.0, tokens at 10.5, 10.6, 10.8, 11.1; response ends at 11.2
    r = rec(10.0, [10.5, 10.6, 10.8, 11.1], done=11.2)
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e == pytest.approx(1.2)
    assert r.num_output_tokens == 4
    assert r.tpot == pytest.approx((1.2 - 0.5) / 3)
    # the server's own token count wins over counted events (OpenAI chunks may carry several tokens)
    r.output_tokens = 8
    assert r.tpot == pytest.approx(0.7 / 7)
    one = rec(0.0, [0.3], done=0.4)
    assert one.tpot is None and one.itls == []
    assert rec(0.0, [], done=1.0).ttft is None


def test_summary_counts_rates_and_distributions_only_over_successes():
    records = [
        rec(0.0, [1.0, 2.0, 3.0], done=3.0),  # ttft 1, tpot 1, e2e 3
        rec(1.0, [1.5, 1.7, 1.9], done=2.0),  # ttft 0.5, tpot 0.25, e2e 1
        rec(2.0, [], done=2.01, status="rejected"),
        rec(2.0, [2.5], done=9.0, status="timeout"),
        rec(3.0, [], done=3.5, status="error"),
    ]
    s = summarize(records, duration_s=4.0)
    assert s["requests"] == 5
    assert s["counts"] == {"ok": 2, "rejected": 1, "timeout": 1, "error": 1}
    assert s["request_per_s"] == pytest.approx(0.5)
    assert s["output_tokens"] == 6 and s["output_tok_per_s"] == pytest.approx(1.5)
    assert s["ttft_s"]["p50"] == pytest.approx(0.75) and s["ttft_s"]["mean"] == pytest.approx(0.75)
    assert s["tpot_s"]["p99"] == pytest.approx(0.25 + 0.75 * 0.99)
    assert s["e2e_s"]["p90"] == pytest.approx(1 + 2 * 0.9)
    assert s["itl_s"]["mean"] == pytest.approx(0.6)  # gaps pooled: 1, 1, 0.2, 0.2
    assert s["itl_s"]["p50"] == pytest.approx(0.6) and s["itl_s"]["p99"] == pytest.approx(1.0)
    assert "goodput_req_per_s" not in s
    with pytest.raises(ValueError):
        summarize(records, 0.0)


def test_goodput_counts_successes_meeting_every_slo():
    records = [
        rec(0.0, [0.5, 0.55, 0.6], done=0.6),  # ttft 0.5, tpot 0.05: good
        rec(0.0, [1.5, 1.55], done=1.55),  # ttft 1.5: misses TTFT
        rec(0.0, [0.2, 0.5, 0.8], done=0.8),  # tpot 0.3: misses TPOT
        rec(0.0, [0.9], done=0.9),  # one token: no TPOT, TTFT ok: good
        rec(0.0, [0.1], done=0.2, status="timeout"),  # not ok: never good
    ]
    s = summarize(records, duration_s=2.0, slo=Slo(ttft=1.0, tpot=0.1))
    assert s["good_requests"] == 2
    assert s["goodput_req_per_s"] == pytest.approx(1.0)
    assert s["slo"] == {"ttft_s": 1.0, "tpot_s": 0.1}
    # an e2e objective is checked too
    assert summarize(records, 2.0, Slo(e2e=0.7))["good_requests"] == 1  # e2e 0.6 only (0.2 is a timeout)
    assert Slo(ttft=1.0).met_by(rec(0.0, [], done=1.0)) is False  # no first token: no TTFT to meet


def test_knee_is_the_first_flat_throughput_with_jumping_latency():
    conc = [1, 2, 4, 8, 16, 32]
    tput = [100, 195, 380, 700, 740, 745]
    lat = [1.0, 1.02, 1.05, 1.15, 2.2, 4.4]
    assert find_knee(conc, tput, lat) == 4  # 8 -> 16: +5.7% throughput, +91% latency
    # 2: flat throughput but latency +30% (calm); 4: +4.8% throughput, latency +54%
    assert find_knee([1, 2, 4], [100, 105, 110], [1.0, 1.3, 2.0]) == 2
    # latency doubles each step but throughput keeps growing 20%: no knee
    assert find_knee([1, 2, 4], [100, 120, 144], [1.0, 2.0, 4.0]) is None
    assert find_knee([1, 2], [100, 90], [1.0, 1.4]) is None
    assert find_knee([1], [100], [1.0]) is None
    with pytest.raises(ValueError):
        find_knee([1, 1], [1, 1], [1, 1])
    with pytest.raises(ValueError):
        find_knee([1, 2], [1], [1, 2])
