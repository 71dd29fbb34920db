"""Speculative decoding's counters under vLLM's names (server/ops/metrics.py spec_decode_families): the
engine's cumulative stats, summed over the versions of one model, acceptance by position labelled."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.api import EngineStats
from server.ops.metrics import spec_decode_families


def _version(model: str, **stats) -> SimpleNamespace:
    return SimpleNamespace(info=SimpleNamespace(model=model), snapshot=SimpleNamespace(stats=EngineStats(**stats)))


def test_spec_decode_counters_as_vllm_names_them():
    versions = [
        _version("m", spec_drafts=3, spec_draft_tokens=10, spec_accepted_tokens=6, spec_accepted_per_pos=[3, 2, 1]),
        _version("m", spec_drafts=1, spec_draft_tokens=4, spec_accepted_tokens=1, spec_accepted_per_pos=[1, 0, 0, 0]),
        _version("other"),
    ]

    class Families:
        def collect(self):
            return spec_decode_families(versions)

    registry = CollectorRegistry()
    registry.register(Families())
    text = generate_latest(registry).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}  # fmt: skip
    m = (("model_name", "m"),)
    assert samples[("vllm:spec_decode_num_drafts_total", m)] == 4
    assert samples[("vllm:spec_decode_num_draft_tokens_total", m)] == 14
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", m)] == 7
    per_pos = {dict(lab)["position"]: v for (n, lab), v in samples.items()
               if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total" and dict(lab)["model_name"] == "m"}  # fmt: skip
    assert per_pos == {"0": 4, "1": 2, "2": 1, "3": 0}
    assert samples[("vllm:spec_decode_num_drafts_total", (("model_name", "other"),))] == 0
    assert "vllm:spec_decode_num_drafts_total{" in text  # the exposition name vLLM's dashboards query
