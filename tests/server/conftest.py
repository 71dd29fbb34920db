"""Server test fixtures: the tiny real model and engines built from it (once per session)."""

from __future__ import annotations

import pytest

from .helpers import build_real_engine, make_settings, run_server


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


@pytest.fixture(scope="module")
def smollm2_server(smollm2_engine):
    """A server over `smollm2_engine`, serving it as "smollm2" (one per test module)."""
    with run_server(make_settings(served_model_name="smollm2", max_model_len=2048), smollm2_engine) as s:
        yield s


@pytest.fixture(scope="module")
def smollm2_client(smollm2_server):
    """The openai SDK against `smollm2_server` (no retries: a failure shows as it is)."""
    import openai

    return openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def srv(real_engine):
    """A server with the test settings over `real_engine`, one per module (a module that needs other
    settings or another engine defines its own `srv`)."""
    with run_server(make_settings(), real_engine) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    """The openai SDK against `srv` (no retries: a failure shows as it is)."""
    import openai

    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
