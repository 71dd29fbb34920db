"""Fake engines that tell model versions apart: each `salt` shifts the made-up tokens (so two versions
answer differently), and log-probabilities are reported when asked (a probe needs them)."""

from __future__ import annotations

from typing import Any

from engine.api import TokenLogprob
from engine.sched.outputs import ModelRunnerOutput, SchedulerOutput

from .fake_engine import OFFSET, FakeEngine


def salted_token(prompt: list[int], num_output: int, salt: int) -> int:
    """The token a request samples next under version `salt`: a lowercase letter, never EOS."""
    return OFFSET + ord("a") + (sum(prompt) + 7 * num_output + salt) % 26


class SaltedRunner:
    def __init__(self, salt: int) -> None:
        self.salt = salt

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        sampled, logprobs = {}, {}
        for s in sched.scheduled:
            if not s.sample:
                continue
            req = s.request
            token = salted_token(req.prompt_token_ids, req.num_output_tokens, self.salt)
            sampled[req.request_id] = token
            if req.params.logprobs is not None:
                logprobs[req.request_id] = TokenLogprob(token, -0.25)
        return ModelRunnerOutput(sampled, logprobs)


class VersionedFakeEngine(FakeEngine):
    def __init__(self, salt: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.runner = SaltedRunner(salt)


def fake_loader(built: list[Any] | None = None, **kwargs: Any):
    """An admin-API loader: the version's path names its salt (`.../salt-3` -> 3); every engine it builds
    is appended to `built` when given."""

    def load(spec: Any, kv_bytes: int | None) -> VersionedFakeEngine:
        salt = int(str(spec.path).rsplit("salt-", 1)[-1]) if "salt-" in str(spec.path) else 0
        engine = VersionedFakeEngine(salt, **kwargs)
        if built is not None:
            built.append(engine)
        return engine

    return load
