"""Two `tokenmill serve` replicas (tiny model, one engine thread each) behind the real vllm-router from
the registry (the `router` extra), on loopback, as processes (bench/fleet/launcher.py):

- completions, chat and their streams answered through it, with round_robin and cache_aware;
- a replica SIGKILLed while streams run on both: its streams end with an error at the client (no hang),
  the other replica's finish, and every new request is answered by the survivor;
- a replica sent SIGTERM drains: the router takes it out of rotation (its health checks read
  tokenmill's readiness, 503 while draining) while the replica still finishes its streams, every request
  sent meanwhile is answered by the other, and the replica exits 0;
- kv_aware with the replicas' KV-cache events (--kv-events-config): requests sharing a prefix go to the
  replica that computed it, which the router learned only from that replica's events.

Skipped, with the reason, when vllm-router is not installed or cannot run here; under CI that fails.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

from bench.fleet.launcher import Fleet, FleetConfig, router_binary

from ..ci_skips import skip_or_fail

MODEL = "tiny-llama"
REPLICA_ARGS = ("--device", "cpu", "--kv-cache-memory", "64MiB", "--engine-threads", "1", "--max-num-seqs", "8",
                "--log-level", "warning", "--drain-timeout-s", "60")  # fmt: skip
LONG = 1800  # tokens: several seconds of decoding for the tiny model on one thread (max_model_len 2048)


@pytest.fixture(scope="module")
def router_ok() -> str:
    binary = router_binary()
    if binary is None:
        skip_or_fail("vllm-router is not installed (pip install -e '.[router]')")
    assert binary is not None
    try:
        subprocess.run([binary, "--help"], capture_output=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        skip_or_fail(f"vllm-router cannot run on this machine: {exc}")
    return binary


@pytest.fixture(scope="module")
def tiny_model() -> str:
    from engine.testing.make_model import ensure_model

    return str(ensure_model(MODEL))


def fleet(tiny_model: str, tmp_path, policy: str) -> Fleet:
    return Fleet(FleetConfig(model=tiny_model, policy=policy, replica_args=REPLICA_ARGS, log_dir=tmp_path))


def served(url: str) -> float:
    """Requests a replica finished (vllm:request_success_total, every reason)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))  # fmt: skip


class Stream(threading.Thread):
    """One streamed completion through `url`: its text pieces, whether [DONE] came, and the error if any."""

    def __init__(self, url: str, max_tokens: int = LONG, prompt: str = "def main():") -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.prompt = url, max_tokens, prompt
        self.chunks: list[dict] = []
        self.done = False
        self.error: BaseException | None = None
        self.first = threading.Event()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": self.prompt, "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True}  # fmt: skip
        try:
            with httpx.Client(timeout=httpx.Timeout(60, connect=10)) as c, \
                    c.stream("POST", f"{self.url}/v1/completions", json=body) as r:  # fmt: skip
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        continue
                    self.chunks.append(json.loads(line[6:]))
                    self.first.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.first.set()


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_completions_chat_and_streams_through_the_router(router_ok, tiny_model, tmp_path, policy):
    with fleet(tiny_model, tmp_path, policy) as f:
        client = openai.OpenAI(base_url=f"{f.url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [MODEL]
        for i in range(4):
            c = client.completions.create(model=MODEL, prompt=f"import os{i}", max_tokens=5, temperature=0)
            assert c.usage.completion_tokens == 5 and c.choices[0].text
            chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Hi {i}"}],
                                                  max_tokens=5, temperature=0)  # fmt: skip
            assert chat.usage.completion_tokens == 5 and chat.choices[0].message.role == "assistant"
        pieces = list(client.completions.create(model=MODEL, prompt="def f():", max_tokens=6, stream=True,
                                                temperature=0, stream_options={"include_usage": True}))  # fmt: skip
        assert pieces[-1].usage.completion_tokens == 6 and "".join(p.choices[0].text for p in pieces if p.choices)
        chat_pieces = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Yo"}],
                                                          max_tokens=6, stream=True, temperature=0))  # fmt: skip
        assert chat_pieces[-1].choices[0].finish_reason == "length"
        # the same greedy answer through the router as from a replica directly
        direct = httpx.post(f"{f.replicas[1].url}/v1/completions", timeout=60,
                            json={"model": MODEL, "prompt": "import os0", "max_tokens": 5, "temperature": 0}).json()
        again = client.completions.create(model=MODEL, prompt="import os0", max_tokens=5, temperature=0)
        assert again.choices[0].text == direct["choices"][0]["text"]
        counts = [served(r.url) for r in f.replicas]
        assert sum(counts) == 4 * 2 + 2 + 2
        if policy == "round_robin":
            assert min(counts) >= 4, counts  # both replicas took their turns


def test_a_killed_replica_fails_its_streams_cleanly_and_the_other_takes_the_new_requests(router_ok, tiny_model,
                                                                                         tmp_path):  # fmt: skip
    with fleet(tiny_model, tmp_path, "round_robin") as f:
        victim, survivor = f.replicas
        streams = [Stream(f.url) for _ in range(4)]  # round robin: two on each replica
        for s in streams:
            s.start()
        for s in streams:
            assert s.first.wait(60) and s.error is None, s.error
        loads = [httpx.get(f"{r.url}/get_load").json()["load"] for r in f.replicas]
        assert loads == [2, 2], loads
        before = served(survivor.url)
        victim.signal(signal.SIGKILL)
        for s in streams:
            s.join(90)
            assert not s.is_alive(), "a stream through the router hangs after its replica was killed"
        broken = [s for s in streams if not s.done]
        finished = [s for s in streams if s.done]
        assert len(broken) == 2 and len(finished) == 2, [(s.done, s.error) for s in streams]
        for s in broken:  # the client sees the stream break (no [DONE]): an error, not a silent short answer
            assert s.error is not None and len(s.chunks) < LONG
        for s in finished:
            assert s.error is None and sum(len(c["choices"]) for c in s.chunks) >= LONG
        t0 = time.monotonic()
        for i in range(6):  # at once: the router retries a refused connection on the other replica
            r = httpx.post(f"{f.url}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": f"x{i}", "max_tokens": 3})  # fmt: skip
            assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < 30
        assert served(survivor.url) == before + 2 + 6
        assert f.healthy_workers() == {survivor.url}


def test_a_draining_replica_leaves_the_rotation_before_it_exits(router_ok, tiny_model, tmp_path):
    with fleet(tiny_model, tmp_path, "round_robin") as f:
        leaving, staying = f.replicas
        streams = [Stream(leaving.url) for _ in range(3)]  # in flight on the replica that will drain
        for s in streams:
            s.start()
        for s in streams:
            assert s.first.wait(60) and s.error is None, s.error
        before = served(staying.url)
        leaving.signal(signal.SIGTERM)
        answered = 0
        deadline = time.monotonic() + 30
        while leaving.url in f.healthy_workers():  # meanwhile the router retries the 503s on the other
            assert time.monotonic() < deadline, "the router kept the draining replica in rotation"
            r = httpx.post(f"{f.url}/v1/completions", timeout=60, json={"model": MODEL, "prompt": "a", "max_tokens": 2})
            assert r.status_code == 200, r.text
            answered += 1
        assert leaving.alive(), "the replica exited before the router took it out (streams too short?)"
        assert any(s.is_alive() for s in streams), "the drain ended before the router took the replica out"
        for i in range(4):
            r = httpx.post(f"{f.url}/v1/completions", timeout=60, json={"model": MODEL, "prompt": f"b{i}", "max_tokens": 2})
            assert r.status_code == 200, r.text
        for s in streams:  # the drain lets them finish
            s.join(120)
            assert s.done and s.error is None, s.error
        assert leaving.proc.wait(timeout=60) == 0
        assert served(staying.url) == before + answered + 4


def prefix_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))  # fmt: skip


def test_kv_aware_sends_a_shared_prefix_to_the_replica_that_holds_it(router_ok, tiny_model, tmp_path):
    """The replicas publish KV-cache events (--kv-events-config), the router subscribes (kv_aware). Two
    long prefixes are computed on one replica each, sent there directly (the router never saw them):
    the requests through the router that share a prefix all go to the replica that holds it, and find
    it there (its prefix-hit counter grows by the prefix for each)."""
    from bench.fleet.router import kv_events_wiring

    per, endpoints = kv_events_wiring(2)
    cfg = FleetConfig(model=tiny_model, policy="kv_aware", replica_args=(*REPLICA_ARGS, "--block-size", "16"),
                      per_replica_args=per, kv_event_endpoints=endpoints, log_dir=tmp_path,
                      router_args=("--kv-event-block-size", "16", "--kv-event-model", tiny_model))  # fmt: skip
    prefixes = [" ".join(f"{name}{i} costs {i * 7 % 13} coins;" for i in range(60)) for name in ("apple", "pear")]
    with Fleet(cfg) as f:
        sizes = []
        for prefix, replica in zip(prefixes, reversed(f.replicas), strict=True):  # pear on replica 0
            r = httpx.post(f"{replica.url}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": prefix + " total?", "max_tokens": 2})  # fmt: skip
            sizes.append(r.json()["usage"]["prompt_tokens"])
        assert min(sizes) > 200
        hits = [prefix_hits(r.url) for r in f.replicas]
        count = [served(r.url) for r in f.replicas]
        time.sleep(1.0)  # the events reach the router (ZMQ, one batch per engine step)
        for i in range(3):
            for prefix in prefixes:
                r = httpx.post(f"{f.url}/v1/completions", timeout=60,
                               json={"model": MODEL, "prompt": prefix + f" question {i}?", "max_tokens": 2})  # fmt: skip
                assert r.status_code == 200, r.text
        assert [served(r.url) - c for r, c in zip(f.replicas, count, strict=True)] == [3, 3]
        for replica, before, size in zip(reversed(f.replicas), reversed(hits), sizes, strict=True):
            # each of its 3 requests found the prefix's full blocks but the last one or two
            assert prefix_hits(replica.url) - before >= 3 * (size // 16 - 2) * 16
