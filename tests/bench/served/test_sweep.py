"""Sweep helpers without a server: argument parsing, requests per point, the knee of a series of
load reports, and the plots drawn from a synthetic sweep."""

from __future__ import annotations

import pytest

from bench.served.sweep import knee_of, parse_int_list, plot_sweep, requests_for


def point(c: int, tput: float, e2e_p50: float) -> dict:
    lat = {"mean": e2e_p50, "p50": e2e_p50, "p90": e2e_p50 * 1.2, "p99": e2e_p50 * 1.5}
    return {"concurrency": c, "output_tok_per_s": tput, "e2e_s": lat, "ttft_s": {k: v / 10 for k, v in lat.items()},
            "tpot_s": {k: v / 100 for k, v in lat.items()}}


SERIES = [point(1, 50, 2.0), point(2, 98, 2.1), point(4, 180, 2.4), point(8, 190, 4.6), point(16, 192, 9.0)]


def test_parse_and_requests_per_point():
    assert parse_int_list("1,2,4, 8") == [1, 2, 4, 8]
    for bad in ("", "0,1", "4,2", "2,2"):
        with pytest.raises(ValueError):
            parse_int_list(bad)
    assert [requests_for(c, 2.0, 8) for c in (1, 4, 16, 32)] == [8, 8, 32, 64]


def test_knee_of_a_series():
    k = knee_of(SERIES)
    assert k["concurrency"] == 8 and k["previous_concurrency"] == 4
    assert k["throughput_gain"] == pytest.approx(190 / 180 - 1)
    assert k["latency_growth"] == pytest.approx(4.6 / 2.4 - 1) and k["latency"] == "e2e p50"
    assert knee_of(SERIES[:3]) is None


def test_plots_are_written(tmp_path):
    series = [{"label": "max_num_seqs=8", "points": SERIES, "knee": knee_of(SERIES)},
              {"label": "max_num_seqs=16", "points": SERIES[:3], "knee": None}]
    paths = plot_sweep(series, tmp_path, "synthetic")
    assert sorted(p.name for p in paths) == ["latency_vs_concurrency.png", "latency_vs_throughput.png",
                                              "throughput_vs_concurrency.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size < 200_000
