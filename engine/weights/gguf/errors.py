"""The one error a bad GGUF file raises: it names the file and the problem (a ValueError, so callers
that already turn a bad model into a clear message and exit code 2 need nothing new)."""

from __future__ import annotations

from pathlib import Path


class GGUFError(ValueError):
    """`path: problem`. Raised before any weight is copied, so nothing is half-loaded."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)  # the .gguf file
        self.problem = problem  # what is wrong with it, in words
