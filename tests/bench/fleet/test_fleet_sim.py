"""`bench fleet-sim` run small (4 replicas, 50 tenants): invariants that break when the simulation does.
No timing assertions: the simulated times are the model's, not this machine's."""

from __future__ import annotations

import pytest

from bench.cli import build_parser
from bench.fleet.fleet_sim import POLICIES, PrefixLRU, SimConfig, _Run, arrivals, simulate

# 50 tenants, 5 prompts per replica: the tenants fit neither one cache nor the fleet's 20 places
SMALL = SimConfig(replicas=4, tenants=50, zipf=1.0, cache_tokens=5000, requests=2000, load=0.3, seed=3)


@pytest.fixture(scope="module")
def results():
    return {p: simulate(SMALL, p) for p in POLICIES}


def test_every_request_is_served_once_with_ordered_times():
    times, tenants = arrivals(SMALL)
    for policy in POLICIES:
        sim = _Run(SMALL, policy, times, tenants)
        sim.run()
        assert sim.served == SMALL.requests
        assert all(r >= 0 for r in sim.where)
        for i in range(SMALL.requests):
            assert sim.ttft[i] is not None and sim.done[i] is not None
            assert 0 < sim.ttft[i] <= sim.done[i] - times[i] + 1e-9
        assert sum(sim.router.loads) == 0  # every routed request was counted back


def test_hit_rates_are_fractions_and_prefix_routing_beats_round_robin(results):
    for r in results.values():
        assert 0.0 <= r.hit_rate <= 1.0
        assert r.served == r.requests == SMALL.requests
        assert r.imbalance >= 1.0
    rr = results["round_robin"].hit_rate
    assert results["cache_aware"].hit_rate > rr + 0.1
    assert results["kv_aware"].hit_rate > rr + 0.1
    assert results["cache_aware"].ttft_p50_s < results["round_robin"].ttft_p50_s


def test_round_robin_spreads_requests_evenly(results):
    assert results["round_robin"].imbalance == pytest.approx(1.0, abs=0.01)


def test_deterministic_for_a_seed_and_varies_with_it():
    assert simulate(SMALL, "power_of_two") == simulate(SMALL, "power_of_two")
    other = SimConfig(**{**SMALL.__dict__, "seed": 4})
    assert simulate(other, "power_of_two") != simulate(SMALL, "power_of_two")


def test_no_cache_means_no_hits_and_a_cache_holding_everything_hits_after_first_use():
    none = SimConfig(**{**SMALL.__dict__, "cache_tokens": 0})
    assert simulate(none, "cache_aware").hit_rate == 0.0
    big = SimConfig(**{**SMALL.__dict__, "cache_tokens": 50 * SMALL.system_tokens, "warmup": 0.5})
    ceiling = SMALL.system_tokens / SMALL.prompt_tokens
    assert simulate(big, "cache_aware").hit_rate == pytest.approx(ceiling, abs=0.02)


def test_prefix_lru_evicts_least_recently_used():
    lru = PrefixLRU(2)
    assert lru.store(1) == [] and lru.store(2) == []
    assert lru.lookup(1)
    assert lru.store(3) == [2]
    assert not lru.lookup(2) and lru.lookup(1) and lru.lookup(3)


def test_config_rejects_bad_values_by_name():
    with pytest.raises(ValueError, match="replicas"):
        SimConfig(replicas=0)
    with pytest.raises(ValueError, match="warmup"):
        SimConfig(warmup=1.0)
    with pytest.raises(ValueError, match="capacity_basis"):
        SimConfig(capacity_basis="hot")


def test_cli_runs_small(capsys):
    args = build_parser().parse_args(["fleet-sim", "--replicas", "2", "--tenants", "10", "--requests", "200",
                                      "--policies", "round_robin,kv_aware"])  # fmt: skip
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "| round_robin |" in out and "| kv_aware |" in out
