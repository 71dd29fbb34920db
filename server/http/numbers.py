"""Numbers a request carries as text, bounded before they are parsed, and values cut before an error
echoes them.

Python's int() refuses more than 4,300 digits with a ValueError (a 500 where nothing catches it: a
`logit_bias` key of 5,000 digits did, issue 45), and an error that echoes what it refused can send a
client's megabyte back to it. So: a number read from a string is checked for length first
(`json_int`; a `logit_bias` key, server/api/protocol.py), the body parser's own refusal of a too-long number names the field it sits
in (`number_field`), and a value quoted in an error is cut (`cut`). Integer fields of the bodies are
64-bit (server/api/protocol.py), so what the engine's own errors echo stays short too.
"""

from __future__ import annotations

import re
from typing import Any

import pydantic_core

MAX_NUMBER_DIGITS = 4300  # digits of a JSON number: Python's int() limit, and what the body's parser reads
MIN_INT, MAX_INT = -(2**63), 2**64 - 1  # integer fields: the seed's range, wider than every other's
ECHO_CHARS = 40  # a value quoted in an error: longer ones are cut

_OUT_OF_RANGE = re.compile(r"number out of range at line (\d+) column (\d+)")
_NUMBER_BYTES = frozenset(b"0123456789+-.eE")


def cut(value: Any, limit: int = ECHO_CHARS) -> str:
    """repr(value), cut to about `limit` characters, saying how long it was."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value):,} characters" if isinstance(value, str) else f"{len(text):,} characters as text"
    return f"{text[:limit]}... ({size})"


def json_int(text: str) -> int:
    """json.loads' `parse_int`: a literal of more than MAX_NUMBER_DIGITS digits is a ValueError saying so,
    before int() sees it."""
    if len(text) - text.startswith("-") > MAX_NUMBER_DIGITS:
        raise ValueError(f"a number has more than {MAX_NUMBER_DIGITS} digits")
    return int(text)


def number_field(text: str | bytes, detail: str) -> str | None:
    """The field (a path: `seed`, `prompt_token_ids.3`, `parameters.seed`) holding the number the body's
    parser refused as too long, from its error `detail` ("number out of range at line L column C", C in
    bytes); None for any other error, or when the place cannot be told."""
    match = _OUT_OF_RANGE.search(detail)
    if match is None:
        return None
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    line, column = int(match.group(1)), int(match.group(2))
    start = 0
    for _ in range(line - 1):
        start = raw.find(b"\n", start) + 1
        if start == 0:
            return None
    end = min(start + column, len(raw))  # the parser stops inside the number (past its last digit at most)
    while end > start and raw[end - 1] not in _NUMBER_BYTES:
        end -= 1
    begin = end
    while begin > 0 and raw[begin - 1] in _NUMBER_BYTES:
        begin -= 1
    if begin == end:
        return None
    try:  # the body up to the number, with a 0 in its place: its last open value is the number's field
        value = pydantic_core.from_json(raw[:begin] + b"0", allow_partial=True)
    except ValueError:
        return None
    path: list[str] = []
    while isinstance(value, dict | list) and value:
        key = next(reversed(value)) if isinstance(value, dict) else len(value) - 1
        path.append(str(key))
        value = value[key]
    return ".".join(path) or None
