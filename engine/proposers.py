"""The proposer of a speculative config (engine/speculative.py, engine/suffix_tree.py); plain Python.
The draft model's proposer needs the model loaded, so the engine installs it (engine/draft_model.py)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from engine.request import Request
from engine.spec_config import SpeculativeConfig
from engine.speculative import NgramProposer, Proposer
from engine.suffix_tree import SuffixProposer


@runtime_checkable
class LearningProposer(Protocol):
    """A proposer that learns from finished requests (suffix decoding)."""

    def finished(self, req: Request) -> None:
        """req has ended (any reason): what it generated may be drafted for later requests."""
        ...


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    """The plain-Python proposer of `config`; None when off or for a draft model (installed later)."""
    if config is None or config.method == "draft_model":
        return None
    if config.method == "suffix":
        return SuffixProposer(config)
    return NgramProposer(config)
