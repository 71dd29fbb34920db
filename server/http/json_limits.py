"""A depth bound on every JSON the server parses from a client: the request body, and JSON carried as
text inside it (a schema in `guided_json`, a history tool call's `arguments`). Python's parser and the
code that walks a parsed value recurse per level, so a 5,000-deep value would end in a RecursionError
(a 500); past MAX_JSON_DEPTH it is a 400 naming the field instead.

The depth is measured on the raw text, without building anything: strings are cut out (their brackets
do not count), the brackets left become +1/-1 steps and the deepest point is the largest running sum,
every step in C (a regular expression, bytes.translate, itertools.accumulate), linear in the text.
Malformed text is not judged here beyond its depth: the parser that follows says what is wrong.
"""

from __future__ import annotations

import json
import operator
import re
from itertools import accumulate, repeat
from typing import Any

from server.http.errors import ApiError
from server.http.numbers import json_int

MAX_JSON_DEPTH = 64  # nested arrays/objects; the request body and each JSON text inside it

# A JSON string, escapes included; an unterminated one runs to the end (so a failed match never rescans).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))  # deleted by bytes.translate
_ONE_KIND = bytes.maketrans(b"{}", b"[]")  # depth does not care which kind of bracket
_STEPS = bytes.maketrans(b"[]", b"\x02\x00")  # opener 2, closer 0: minus 1 gives +1 / -1
_PEELS = 4


def too_deep(text: str | bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when `text` nests arrays/objects more than `limit` levels deep."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if raw.count(b"[") + raw.count(b"{") <= limit:  # the common case: cannot be deeper than its openers
        return False
    brackets = _STRING.sub(b"", raw).translate(_ONE_KIND, _NOT_BRACKETS)
    run = b"[" * (limit + 1)
    # An empty pair is a leaf: one pass removing them lowers the deepest point by at most one level,
    # and most of a large value's brackets go with the first passes.
    inner, peeled = brackets, 0
    while peeled < _PEELS and run not in inner:
        inner, peeled = inner.replace(b"[]", b""), peeled + 1
    if run in inner:
        return True
    deepest = _deepest(inner)  # the text's depth is in [deepest, deepest + peeled]
    if deepest + peeled <= limit or deepest > limit:
        return deepest > limit
    return _deepest(brackets) > limit


def _deepest(brackets: bytes) -> int:
    """The largest running sum of +1 per opener, -1 per closer (0 for the empty prefix)."""
    return max(accumulate(map(operator.sub, brackets.translate(_STEPS), repeat(1)), initial=0))


def check_depth(text: str | bytes, field: str) -> None:
    """Raise ApiError 400 naming `field` when the JSON `text` nests deeper than MAX_JSON_DEPTH."""
    if too_deep(text):
        raise ApiError(400, "invalid_request", f"{field} nests deeper than {MAX_JSON_DEPTH} levels of arrays "
                       "and objects", param=field)  # fmt: skip


def loads(text: str | bytes, field: str) -> Any:
    """json.loads with the depth bound and numbers of at most MAX_NUMBER_DIGITS digits
    (server/http/numbers.py). Raises ApiError 400 naming `field` when too deep, ValueError when `text`
    is not JSON or holds a longer number."""
    check_depth(text, field)
    return json.loads(text, parse_int=json_int)
