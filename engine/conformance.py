"""Type-level checks that the engines satisfy the server's contract (engine/api/ EngineProtocol).
Nothing here runs: mypy reads it (tests/test_types.py) and fails when an engine drifts from the protocol."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.api import EngineProtocol
    from engine.core.step_loop import StepLoop
    from engine.engine import Engine

    def _core_is_an_engine(core: StepLoop) -> EngineProtocol:
        return core

    def _engine_is_an_engine(engine: Engine) -> EngineProtocol:
        return engine
