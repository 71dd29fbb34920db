"""Shared fixtures: test models are built once per session from seeded configs (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    env = os.environ.get("TOKENMILL_MODEL_CACHE")
    return Path(env) if env else tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def build_model(model_cache):
    from engine.testing.make_model import ensure_model

    def build(preset: str) -> Path:
        return ensure_model(preset, model_cache)

    return build
