"""The engine's one error type for bad input: `InvalidParam` names the field, so a caller (the HTTP
server) can report it without parsing message text. Torch-free."""

from __future__ import annotations


class InvalidParam(ValueError):
    """A request or config value the engine refuses. `field` is the name as the caller gave it
    (`max_tokens`, `prompt_token_ids`, `temperature`, ...); `message` says why, naming the limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
