"""Server test fixtures: the tiny real model and engines built from it (once per session)."""

from __future__ import annotations

import pytest

from .helpers import build_real_engine


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from engine.testing.make_model import ensure_model

    return str(ensure_model("tiny-llama"))


@pytest.fixture(scope="session")
def real_engine(tiny_model_path: str):
    """One real engine for the session, lent to one server at a time (each server's worker owns it
    while it runs; servers are stopped before the next starts)."""
    return build_real_engine(tiny_model_path)


@pytest.fixture(scope="session")
def offline_engine(tiny_model_path: str):
    """A second engine, used only by the test thread, for reference outputs."""
    return build_real_engine(tiny_model_path)


@pytest.fixture(scope="session")
def engine_with(tiny_model_path: str):
    """Build a real engine with other limits (max_num_seqs, aging_s, ...): the scheduler is the
    engine's, so a test that needs one seat or fast aging needs its own engine (about 0.1 s)."""

    def build(**config):
        return build_real_engine(tiny_model_path, **config)

    return build


@pytest.fixture(scope="session")
def smollm2_engine():
    """The real SmolLM2-135M-Instruct (its own chat template and tokenizer), float32 on the CPU, lent to
    one server at a time like `real_engine`."""
    from .real_model import require_default_model

    return build_real_engine(str(require_default_model()), kv_cache_memory=256 << 20, max_model_len=2048)
