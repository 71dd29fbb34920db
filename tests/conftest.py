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


_TRACE = os.environ.get("TOKENMILL_TEST_TRACE")  # a file: the test now running, for a run that dies


def pytest_sessionstart(session):
    """With TOKENMILL_TEST_TRACE set, faulthandler's tracebacks of a fatal signal go to TRACE.faults:
    pytest's own go to the stderr it captures, lost with the process."""
    if _TRACE:
        import faulthandler

        session.config._tokenmill_faults = open(_TRACE + ".faults", "w")  # noqa: SIM115 (open until exit)
        faulthandler.enable(file=session.config._tokenmill_faults, all_threads=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid, location):
    """Record the test about to run (CI prints it when pytest dies of a signal: a segfault in a kernel
    leaves no report of its own, and faulthandler's cannot run on an overflowed thread stack)."""
    if _TRACE:
        with open(_TRACE, "w") as f:
            f.write(nodeid + "\n")
