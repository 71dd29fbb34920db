"""A missing checker skips its tests on a workstation but fails them in CI, so a broken `make tools`
cannot turn the deploy suite green by skipping it."""

from __future__ import annotations

import pytest

from .conftest import find_tool

MISSING = "tokenmill-no-such-tool"


def test_missing_tool_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        find_tool(MISSING)


def test_missing_tool_skips_elsewhere(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="make tools"):
        find_tool(MISSING)
