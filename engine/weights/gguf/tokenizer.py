"""The tokenizer of a GGUF file: transformers builds a fast tokenizer (vocabulary, merges, special
tokens, chat template) from the metadata; the stop tokens are every end-of-generation id the file
names, as llama.cpp stops on all of them."""

from __future__ import annotations

from typing import Any

from engine.weights.gguf.errors import GGUFError
from engine.weights.gguf.reader import GGUFFile

# eos: end of text; eot: end of turn (Llama 3's <|eot_id|>); eom: end of message (tool calls)
_STOP_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def load_tokenizer(gf: GGUFFile) -> Any:
    """A transformers fast tokenizer built from the file's metadata. GGUFError when it cannot be."""
    if "tokenizer.ggml.tokens" not in gf.array_lengths:
        raise GGUFError(gf.path, "no tokenizer in the metadata (tokenizer.ggml.tokens is missing)")
    # PreTrainedTokenizerFast, not AutoTokenizer: the same tokenizer (AutoTokenizer picks this class for
    # a GGUF too), but AutoTokenizer first rebuilds the model config by parsing the whole file again,
    # 3 s of the ~3.3 s it takes for SmolLM2's 49k-token vocabulary.
    from transformers import PreTrainedTokenizerFast

    path = gf.path.resolve()
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises several types for an unusable vocabulary
        raise GGUFError(gf.path, f"cannot build a tokenizer from the metadata: {type(exc).__name__}: {exc}") from exc


def eos_token_ids(gf: GGUFFile, tokenizer: Any) -> frozenset[int]:
    """Ids that end a generation: the file's eos/eot/eom ids and the tokenizer's eos token."""
    ids = {int(gf.get(key)) for key in _STOP_KEYS if gf.get(key) is not None}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
