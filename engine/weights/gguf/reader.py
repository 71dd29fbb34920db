"""Open and validate a GGUF file with the `gguf` package. Tensor data stays memory-mapped (copy-on-write
pages, so nothing is read before it is used and the file is never written).

Every problem is a GGUFError naming the file: not a GGUF file, an unreadable version, a truncated or
corrupt file, a tensor type we cannot dequantize. All of it is checked here, before any weight is
copied anywhere.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderTensor

from engine.weights.gguf.dequant import SUPPORTED_TYPES
from engine.weights.gguf.errors import GGUFError

MAGIC = b"GGUF"
_HEADER_BYTES = 24  # magic, version (u32), tensor count (u64), metadata count (u64)
_UNKNOWN_TYPE = re.compile(r"(\d+)\)? is not a valid GGMLQuantizationType")  # numpy 2 reprs np.uint32(99)
_BAD_VERSION = re.compile(r"version (\d+)")
_MAX_READ_ARRAY = 4096  # longest model array field read (per-layer values: one per layer)
# bytes of each fixed-size metadata value type (gguf's GGUFValueType; strings and arrays are not fixed)
_ITEM_BYTES = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1, GGUFValueType.UINT16: 2,
               GGUFValueType.INT16: 2, GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
               GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}  # fmt: skip


@dataclass(frozen=True, eq=False)  # eq=False: no field-by-field comparison of memory maps
class GGUFFile:
    """An opened, validated GGUF file."""

    path: Path  # the .gguf file
    size: int  # its size in bytes
    architecture: str  # general.architecture, e.g. "llama"
    metadata: dict[str, Any]  # every non-array metadata field by key (ints, floats, bools, strings)
    array_lengths: dict[str, int]  # every array field by key -> its length (e.g. tokenizer.ggml.tokens)
    tensors: tuple[ReaderTensor, ...]  # in file order; .data views the memory map
    data: np.memmap  # the whole file, mapped copy-on-write (never written)
    # the values of the model's own array fields (per-layer settings such as Gemma's
    # attention.sliding_window_pattern); the tokenizer's arrays are left unread
    arrays: dict[str, list[Any]] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.tensors}

    def release(self, t: ReaderTensor) -> None:
        """Drop `t`'s file pages from this process's memory once it was copied (they only count against
        RSS then). Safe: the map is never written, so a later read re-reads them from the file."""
        mapped = getattr(self.data, "_mmap", None)  # numpy's mmap object (no public accessor)
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if mapped is None or advice is None or not hasattr(mapped, "madvise"):
            return
        start = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        mapped.madvise(advice, start, t.data_offset + t.n_bytes - start)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Read and validate `path`. Raises GGUFError naming the file and the problem."""
    path = Path(path)
    size = _check_header(path)
    reader = _read(path, size)
    metadata, arrays, values = _fields(reader)
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GGUFError(path, "no general.architecture in the metadata (not a model file?)")
    parts = metadata.get("split.count", 1) or 1
    if parts > 1:
        raise GGUFError(path, f"one part of a split GGUF ({parts} files); merge them first "
                              "(llama-gguf-split --merge)")  # fmt: skip
    tensors = tuple(reader.tensors)
    for t in tensors:
        _check_tensor(path, size, t)
    return GGUFFile(path, size, arch, metadata, arrays, tensors, reader.data, values)


def _check_header(path: Path) -> int:
    if not path.is_file():
        raise GGUFError(path, "no such file")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(_HEADER_BYTES)
    if head[:4] != MAGIC and not MAGIC.startswith(head):
        raise GGUFError(path, f"not a GGUF file: it starts with {head[:4]!r}, a GGUF file with {MAGIC!r}")
    if len(head) < _HEADER_BYTES:
        raise GGUFError(path, f"truncated: {size} bytes, shorter than a GGUF header ({_HEADER_BYTES} bytes)")
    return size


class _DataPastEnd(Exception):
    """A tensor's data could not be mapped: the file ends before it."""


class _Reader(GGUFReader):
    """GGUFReader that tells a failure in the tensor data (the metadata before it parsed) from one in
    the metadata (if a gguf release renames the hook, failures simply get the generic message), and
    skips over long arrays instead of reading them."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        """gguf builds one numpy view per array item: 786,432 of them for a Gemma 3 file's 262,144-token
        vocabulary (tokens, scores, types), 40 s of opening it on a busy machine. An array longer than
        _MAX_READ_ARRAY (the tokenizer's: the engine needs only their lengths; transformers reads the
        vocabulary itself) is stepped over in one pass instead; its field keeps the item type and the
        length (parts [.., item type, length], no items). Big-endian files keep gguf's own path."""
        if raw_type == GGUFValueType.ARRAY and self.byte_order != "S":
            item_type, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            count, item = int(length[0]), GGUFValueType(int(item_type[0]))
            if count > _MAX_READ_ARRAY and (item in _ITEM_BYTES or item == GGUFValueType.STRING):
                end = _skip_items(self.data, orig_offs + 12, item, count)
                return end - orig_offs, [item_type, length], [], [GGUFValueType.ARRAY, item]
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_tensors(self, start_offs, fields) -> None:
        try:
            super()._build_tensors(start_offs, fields)
        except (ValueError, IndexError) as exc:
            if _UNKNOWN_TYPE.search(str(exc)):
                raise
            raise _DataPastEnd(str(exc)) from exc


def _skip_items(data: np.ndarray, start: int, item: GGUFValueType, count: int) -> int:
    """The offset just past `count` items of type `item` from `start` (strings: a little-endian u64
    length, then the bytes). IndexError when the file ends first."""
    if item != GGUFValueType.STRING:
        end = start + count * _ITEM_BYTES[item]
    else:
        view, end = memoryview(data), start
        try:
            for _ in range(count):
                end += 8 + struct.unpack_from("<Q", view, end)[0]
        except struct.error as exc:
            raise IndexError(f"string array runs past the end of the file: {exc}") from None
    if end > data.shape[0]:
        raise IndexError(f"array runs past the end of the file (to byte {end})")
    return end


def _read(path: Path, size: int) -> GGUFReader:
    """The reader, with its errors turned into what they mean for this file."""
    try:
        return _Reader(path, mode="c")
    except _DataPastEnd:
        raise GGUFError(path, f"truncated: tensor data runs past the end of the file ({size} bytes)") from None
    except ValueError as exc:
        text = str(exc)
        if m := _UNKNOWN_TYPE.search(text):
            raise GGUFError(path, f"a tensor has unknown tensor type {m.group(1)} (not a ggml type)") from None
        if "version" in text and (m := _BAD_VERSION.search(text)):
            raise GGUFError(path, f"GGUF version {m.group(1)} is not supported (readable: 2, 3)") from None
        raise GGUFError(path, _unreadable(size, exc)) from None
    except (IndexError, KeyError, OverflowError, UnicodeDecodeError, MemoryError) as exc:
        raise GGUFError(path, _unreadable(size, exc)) from None


def _unreadable(size: int, exc: Exception) -> str:
    return f"truncated or corrupt: its metadata cannot be read ({size} bytes; {type(exc).__name__}: {exc})"


def _fields(reader: GGUFReader) -> tuple[dict[str, Any], dict[str, int], dict[str, list[Any]]]:
    metadata: dict[str, Any] = {}
    arrays: dict[str, int] = {}
    values: dict[str, list[Any]] = {}
    for key, f in reader.fields.items():
        if f.types and f.types[0] == GGUFValueType.ARRAY:
            # parts: key length, key, value type, item type, length, items (none for a long array)
            arrays[key] = int(f.parts[4][0])  # the tokenizer's values stay unread: transformers reads them itself
            if not key.startswith("tokenizer.") and arrays[key] <= _MAX_READ_ARRAY:
                values[key] = list(f.contents())
        else:
            metadata[key] = f.contents()
    return metadata, arrays, values


def _check_tensor(path: Path, size: int, t: ReaderTensor) -> None:
    if t.tensor_type not in SUPPORTED_TYPES:
        names = ", ".join(q.name for q in SUPPORTED_TYPES)
        raise GGUFError(path, f"tensor {t.name!r} has type {t.tensor_type.name}, which tokenmill cannot "
                              f"dequantize (supported: {names})")  # fmt: skip
    if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
        raise GGUFError(path, f"truncated: tensor {t.name!r} runs past the end of the file ({size} bytes)")
