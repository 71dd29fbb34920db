"""bench contention: its variants and what they pass to the server, and the summary table."""

from __future__ import annotations

import argparse

import pytest

from bench.served.contention import Variant, format_summary, parse_variant, server_env


def test_variants_parse_to_server_flags_and_environment():
    assert parse_variant("2") == Variant(2, "", False)
    assert parse_variant("2:fixed").serve_args() == ["--engine-threads", "2", "--no-adaptive-threads"]
    assert parse_variant("2").serve_args() == ["--engine-threads", "2", "--adaptive-threads"]
    assert parse_variant("1").serve_args() == ["--engine-threads", "1", "--no-adaptive-threads"]
    assert parse_variant("2:passive:fixed") == Variant(2, "PASSIVE", True)
    assert parse_variant("2:SPIN=30000000").wait_policy == "SPIN=30000000"
    assert parse_variant("1").label == "1 thread, default, fixed"
    assert parse_variant("2").label == "2 threads, default, adaptive"
    for bad in ("0", "x", "2:sometimes", "2:fixed:fixed", "2:SPIN=lots"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_variant(bad)


def test_summary_means_quiet_and_busy_per_variant():
    rows = [{"variant": "a", "busy": False, "output_tok_s": 100.0}, {"variant": "a", "busy": False, "output_tok_s": 50.0},
            {"variant": "a", "busy": True, "output_tok_s": 10.0}, {"variant": "b", "busy": True, "output_tok_s": 7.0}]
    assert format_summary(rows).splitlines()[2:] == ["| a | 75.0 | 10.0 |", "| b | - | 7.0 |"]


def test_the_server_sees_only_the_variant_s_openmp_variables():
    assert server_env(parse_variant("2")) == {"OMP_WAIT_POLICY": None, "OMP_NUM_THREADS": None, "GOMP_SPINCOUNT": None}
    assert server_env(parse_variant("2:PASSIVE"))["OMP_WAIT_POLICY"] == "PASSIVE"
    spin = server_env(parse_variant("2:SPIN=1000:fixed"))
    assert spin["GOMP_SPINCOUNT"] == "1000" and spin["OMP_WAIT_POLICY"] is None
