"""The proposer of a speculative config (engine/spec/drafts.py, engine/spec/suffix_tree.py); plain Python.
The draft model's proposer needs the model loaded, so the engine installs it (engine/runner/draft_model.py)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from engine.config.speculative import SpeculativeConfig
from engine.request import Request
from engine.spec.drafts import NgramProposer, Proposer
from engine.spec.suffix_tree import SuffixProposer


@runtime_checkable
class LearningProposer(Protocol):
    """A proposer that learns from finished requests (suffix decoding)."""

    def finished(self, req: Request) -> None:
        """req has ended (any reason): what it generated may be drafted for later requests."""
        ...


@runtime_checkable
class BatchProposer(Protocol):
    """A proposer that drafts for many requests at once more cheaply than one by one (the draft model:
    one batched forward per draft position). The scheduler asks it once per step for every row that
    may speculate; a row given fewer draft slots takes a prefix of its drafts."""

    def propose_all(self, items: list[tuple[Request, int]]) -> list[list[int]]:
        """For each (request, k), at most k draft tokens (as Proposer.propose), in order."""
        ...


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    """The plain-Python proposer of `config`; None when off or for a draft model (installed later)."""
    if config is None or config.method == "draft_model":
        return None
    if config.method == "suffix":
        return SuffixProposer(config)
    return NgramProposer(config)
