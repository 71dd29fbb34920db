"""Type-level checks that the engines satisfy the server's contract (engine/api.py EngineProtocol).
Nothing here runs: mypy reads it (tests/test_types.py) and fails when an engine drifts from the protocol."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.api import EngineProtocol
    from engine.core import EngineCore
    from engine.engine import Engine

    def _core_is_an_engine(core: EngineCore) -> EngineProtocol:
        return core

    def _engine_is_an_engine(engine: Engine) -> EngineProtocol:
        return engine
