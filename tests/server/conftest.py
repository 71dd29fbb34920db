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
