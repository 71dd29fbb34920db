"""A mixed batch through the server: requests on the base model and three PEFT adapters sent together to
an engine with a KV cache far smaller than the batch needs (14 blocks of 16 tokens), so the engine
preempts and recomputes; every answer equals the same request run alone (through the server, and by
transformers + PEFT)."""

from __future__ import annotations

import httpx
import pytest

from tests.engine.lora_helpers import SPECS, make_adapter, peft_greedy, random_prompts

from ..helpers import (
    Background,
    ControlledEngine,
    build_real_engine,
    make_settings,
    park_filler,
    run_server,
    wait_until,
)

LENGTHS = [1, 9, 40, 75, 130]  # the longest request needs 9 of the 14 blocks; the batch needs far more
MAX_TOKENS = 10
NAMES = [None, *SPECS]


@pytest.fixture(scope="module")
def setup(tiny_model_path, tmp_path_factory):
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("lora-preempt")
    adapters = {name: make_adapter(tiny_model_path, root / name, spec) for name, spec in SPECS.items()}
    prompts = random_prompts(AutoConfig.from_pretrained(tiny_model_path).vocab_size, LENGTHS, seed=11)
    refs = {name: peft_greedy(tiny_model_path, adapters.get(name) if name else None, prompts, MAX_TOKENS)
            for name in NAMES}  # fmt: skip
    return adapters, prompts, refs


def body(prompt: list[int], name: str | None) -> dict:
    out = {"prompt_token_ids": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": False}
    return out if name is None else {**out, "model": name}


def test_mixed_batch_under_preemption_equals_one_request_runs(tiny_model_path, setup):
    from engine.config.lora import LoraConfig

    adapters, prompts, refs = setup
    modules = tuple((name, str(path)) for name, path in adapters.items())
    engine = ControlledEngine(build_real_engine(tiny_model_path, num_kv_blocks=14, block_size=16,
                                                lora=LoraConfig(max_loras=4, modules=modules)))  # fmt: skip
    settings = make_settings(enable_lora=True, max_loras=4, served_model_name="tiny", max_num_seqs=32)
    with run_server(settings, engine) as srv, Background() as bg:
        for name in NAMES:  # one at a time: nothing to preempt
            for i, prompt in enumerate(prompts):
                r = httpx.post(f"{srv.url}/generate", json=body(prompt, name), timeout=60)
                assert r.status_code == 200 and r.json()["token_ids"] == refs[name][i], (name, i)
        stats = srv.runtime.primary.worker.stats
        assert stats.preemptions == 0
        filler = park_filler(srv, engine, bg, body(prompts[1], None))  # hold the worker: the rest go in together
        jobs = [(name, i) for i in range(len(prompts)) for name in NAMES]
        futures = [bg.post(f"{name}-{i}", f"{srv.url}/generate", body(prompts[i], name)) for name, i in jobs]
        worker = srv.runtime.primary.worker
        wait_until(lambda: worker.in_flight() == len(jobs) + 1, what="every request admitted")  # then one batch
        engine.gate.set()
        for (name, i), future in zip(jobs, futures, strict=True):
            r = future.result()
            assert r.status_code == 200, r.text
            assert r.json()["token_ids"] == refs[name][i], (name, i)
        assert filler.result().json()["token_ids"] == refs[None][1]
        assert srv.runtime.primary.worker.stats.preemptions > 0
        assert srv.wait_idle()["kv_blocks_used"] == 0
