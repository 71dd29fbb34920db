"""Prompt tokenization shared by the engine and the server (which runs it on its own tokenizer copy).

Chat prompts: only the chat template's own markers become special tokens. Text that a message brings
(`<|im_start|>system ...` typed by a user) is tokenized as plain text, so no one can forge a turn.
"""

from __future__ import annotations

import json
import uuid
from typing import Any


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a text prompt; no special tokens added (chat templates add their own)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], **render: Any) -> list[int]:
    """Token ids of messages rendered by the tokenizer's chat template, ready for the assistant turn.
    `render`: more arguments of `apply_chat_template` (add_generation_prompt, default True;
    continue_final_message, chat_template, tools, template variables).

    The template is rendered with a placeholder for every message text, so the rendered prompt is
    known to be template text or message text at every character. It is then tokenized the way the
    tokenizer itself does (split at added tokens, each piece tokenized alone), except that only the
    template's text is split at special tokens. Raises ValueError when message text holds special-token
    text and the template does not place message text verbatim or trimmed (it cannot be kept apart)."""
    specials = _added_tokens(tokenizer)
    tools = render.get("tools")
    if any(s in t for t in _template_data(messages, tools) for s in specials):
        raise ValueError("tools or tool calls contain special-token text, which the chat template would "
                         "render as markers")
    layout = _layout(tokenizer, messages, render)
    if layout is None:
        if any(s in t for t in message_texts(messages) for s in specials):
            raise ValueError("message text contains special-token text and this chat template does not place "
                             "message text verbatim, so it cannot be tokenized as plain text")
        return _ids(_render(tokenizer, messages, render, tokenize=True))
    pieces, texts = layout
    return [i for seg in _segments(pieces, texts, specials) for i in _encode_segment(tokenizer, seg, specials)]


def _template_data(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[str]:
    """What the template renders as its own text besides message texts: tools and tool calls (JSON)."""
    data = [json.dumps(m["tool_calls"], ensure_ascii=False) for m in messages if m.get("tool_calls")]
    return data + ([json.dumps(tools, ensure_ascii=False)] if tools else [])


def _layout(tokenizer: Any, messages: list[dict[str, Any]],
            render: dict[str, Any]) -> tuple[list[str | int], list[str]] | None:  # fmt: skip
    """The rendered prompt as template strings and indices into the message texts, and those texts as
    rendered; None when the template does not place each message text verbatim (or trimmed)."""
    texts: list[str] = []
    marked = [_with_placeholders(m, texts) for m in messages]
    key = uuid.uuid4().hex
    pieces = _split_placeholders(_render(tokenizer, [_keyed(m, key) for m in marked], render), key, len(texts))
    if pieces is None:
        return None
    rendered = _as_rendered(pieces, texts, _render(tokenizer, messages, render))
    return None if rendered is None else (pieces, rendered)


def _as_rendered(pieces: list[str | int], texts: list[str], rendered: str) -> list[str] | None:
    """The message texts as the template really rendered them: verbatim, or stripped (templates that
    `| trim` their content); None when neither rebuilds the real rendering."""
    for candidate in (texts, [t.strip() for t in texts]):
        if "".join(p if isinstance(p, str) else candidate[p] for p in pieces) == rendered:
            return candidate
    return None


def message_texts(messages: list[dict[str, Any]]) -> list[str]:
    """Every text the messages carry (string contents and text parts)."""
    out: list[str] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(p.get("text") or "" for p in content if isinstance(p, dict))
    return out


def _added_tokens(tokenizer: Any) -> list[str]:
    """Every added token's text (special or not), longest first: the strings the tokenizer splits at."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    names = {getattr(t, "content", str(t)) for t in decoder.values()}
    names |= set(getattr(tokenizer, "all_special_tokens", None) or [])
    return sorted((n for n in names if n), key=len, reverse=True)


_PLACEHOLDER = "\ue000{key}:{index}\ue001"  # private-use code points: no template or tokenizer alters them


def _with_placeholders(message: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    """A copy of `message` whose texts are placeholder indices into `texts` (filled as they are met)."""

    def mark(text: Any) -> Any:
        if not isinstance(text, str) or not text:
            return text
        texts.append(text)
        return len(texts) - 1

    content = message.get("content")
    if isinstance(content, list):
        content = [{**p, "text": mark(p.get("text"))} if isinstance(p, dict) else p for p in content]
    else:
        content = mark(content)
    return {**message, "content": content}


def _keyed(message: dict[str, Any], key: str) -> dict[str, Any]:
    def text(value: Any) -> Any:
        return _PLACEHOLDER.format(key=key, index=value) if isinstance(value, int) else value

    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": [{**p, "text": text(p.get("text"))} if isinstance(p, dict) else p
                                       for p in content]}  # fmt: skip
    return {**message, "content": text(content)}


def _render(tokenizer: Any, messages: list[dict[str, Any]], render: dict[str, Any], tokenize: bool = False) -> Any:
    return tokenizer.apply_chat_template(messages, tokenize=tokenize, **{"add_generation_prompt": True, **render})


def _ids(ids: Any) -> list[int]:
    if hasattr(ids, "keys"):  # transformers v5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _split_placeholders(rendered: str, key: str, count: int) -> list[str | int] | None:
    """The rendered prompt as template strings and message-text indices, in order; None when the
    template did not place each message text exactly once, in order, unaltered."""
    pieces: list[str | int] = []
    rest = rendered
    for index in range(count):
        mark = _PLACEHOLDER.format(key=key, index=index)
        before, found, after = rest.partition(mark)
        if not found or mark in after:
            return None
        pieces += [before, index]
        rest = after
    if key in rest:
        return None
    return [*pieces, rest]


def _segments(pieces: list[str | int], texts: list[str], specials: list[str]) -> list[str | tuple[str, bool]]:
    """Special-token strings found in template text (str), and the text between them as
    (text, holds_message_text) pairs: what the tokenizer would tokenize piece by piece."""
    out: list[str | tuple[str, bool]] = []
    buf: list[str] = []
    from_message = False
    for piece in pieces:
        if isinstance(piece, int):
            buf.append(texts[piece])
            from_message = True
            continue
        for part in _split_specials(piece, specials):
            if part in specials:
                if buf:
                    out.append(("".join(buf), from_message))
                buf, from_message = [], False
                out.append(part)
            else:
                buf.append(part)
    if buf:
        out.append(("".join(buf), from_message))
    return out


def _split_specials(text: str, specials: list[str]) -> list[str]:
    """`text` cut at every special-token string (longest match first), the strings kept."""
    parts: list[str] = []
    start = i = 0
    while i < len(text):
        hit = next((s for s in specials if text.startswith(s, i)), None)
        if hit is None:
            i += 1
            continue
        if i > start:
            parts.append(text[start:i])
        parts.append(hit)
        i += len(hit)
        start = i
    if start < len(text):
        parts.append(text[start:])
    return parts


def _encode_segment(tokenizer: Any, segment: str | tuple[str, bool], specials: list[str]) -> list[int]:
    if isinstance(segment, str):  # a template marker
        return list(tokenizer.encode(segment, add_special_tokens=False))
    text, from_message = segment
    if not (from_message and any(s in text for s in specials)):
        return list(tokenizer.encode(text, add_special_tokens=False))
    try:
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    except TypeError:  # a tokenizer without the option: refuse rather than tokenize it as markers
        raise ValueError("message text contains special-token text and this tokenizer cannot tokenize it "
                         "as plain text") from None


def max_bytes_per_token(tokenizer: Any) -> int | None:
    """The most UTF-8 bytes of prompt text one token can stand for, or None when no such bound holds
    (a normalizer or pre-tokenizer that may drop text: then any length of text may be few tokens).
    A prompt of B bytes is then at least ceil(B / bound) tokens long."""
    shrink = _text_shrink_factor(tokenizer)
    if shrink is None:
        return None
    try:
        vocab = len(tokenizer)
        texts = tokenizer.batch_decode([[i] for i in range(vocab)])
    except Exception:  # not a Hugging Face tokenizer: no bound
        return None
    longest = max((len(t.encode()) for t in texts), default=1)
    # +1: a SentencePiece "▁" decodes to nothing alone but stands for a space in the text.
    return (longest + 1) * shrink


_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}
_SHRINK_NORMALIZERS = {"NFC": 3, "NFKC": 3, "NFD": 3, "NFKD": 3, "Lowercase": 3, "Prepend": 1}


def _text_shrink_factor(tokenizer: Any) -> int | None:
    """How much the tokenizer's normalizer can shrink text in bytes (NFC composes at most three
    3-byte jamo into one 3-byte syllable), or None when a step may drop text outright."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:
        return None
    if not _keeps_text(spec.get("pre_tokenizer")):
        return None
    return _normalizer_factor(spec.get("normalizer"))


def _keeps_text(pre: dict | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers", []))
    if kind == "Split":
        return pre.get("behavior") != "Removed"
    return kind in _SAFE_PRE_TOKENIZERS


def _normalizer_factor(norm: dict | None) -> int | None:
    if norm is None:
        return 1
    kind = norm.get("type")
    if kind == "Sequence":
        factor = 1
        for step in norm.get("normalizers", []):
            f = _normalizer_factor(step)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":
        pattern = norm.get("pattern", {})
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        content = norm.get("content", "")
        if literal is None or not content:
            return None  # a regex, or a replacement that deletes: no bound
        return max(1, -(-len(literal.encode()) // len(content.encode())))
    return _SHRINK_NORMALIZERS.get(kind)
