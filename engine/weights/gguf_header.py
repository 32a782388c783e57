"""A GGUF file's header read quickly: its scalar metadata and its tensors' names, types, shapes and
offsets, without gguf.GGUFReader's per-string numpy slicing (seconds for a 49k-token vocabulary, half
of a warm load). Array values (the vocabulary, merges) are skipped, only where they are kept:
read_array reads one when it is wanted (a cold load's tokenizer, Gemma's layer pattern), numbers
with one numpy call, strings in one pass over their bytes.

The layout is GGUF v2/v3's (ggml's docs/gguf.md), little-endian: magic, version, tensor count, key
count; keys (string, type, value); tensor infos (name, dims, type, offset); data, aligned to
general.alignment (32 by default).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# GGUF value types -> struct format (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_U64 = struct.Struct("<Q")


class HeaderError(ValueError):
    """Not a GGUF header this can read (`truncated`: the file ends before its header or data does)."""

    def __init__(self, message: str, truncated: bool = False, type_id: int | None = None) -> None:
        super().__init__(message)
        self.truncated, self.type_id = truncated, type_id  # type_id: a tensor type the gguf package lacks


@dataclass
class TensorInfo:
    name: str
    type_name: str  # gguf.GGMLQuantizationType name
    shape: tuple[int, ...]  # GGUF order (innermost first)
    offset: int  # from the file's start
    n_bytes: int


@dataclass(frozen=True)
class ArrayInfo:
    """Where an array value is in the file: its item type, length, and the offset of its first item."""

    item_type: int
    count: int
    offset: int


@dataclass
class Header:
    fields: dict[str, Any] = field(default_factory=dict)  # scalars and strings
    arrays: dict[str, ArrayInfo] = field(default_factory=dict)  # keys whose value is an array (read_array)
    tensors: list[TensorInfo] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # every key, in the file's order


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.data, self.pos)
        except struct.error as e:
            raise HeaderError("the header ends early", truncated=True) from e
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.data):
            raise HeaderError("the header ends early", truncated=True)
        self.pos += n
        return self.data[self.pos - n : self.pos].decode("utf-8", errors="replace")

    def skip(self, kind: int) -> None:
        if kind == 8:
            length = self.take("<Q")  # (not `self.pos += self.take(...)`: that adds to the old position)
            self.pos += length
        elif kind == 9:
            item, count = self.take("<I"), self.take("<Q")
            if item in _SCALARS:
                self.pos += struct.calcsize(_SCALARS[item]) * count
            elif item == 8:  # strings, each after its length: one tight loop (a vocabulary has 10^5)
                self.pos = _skip_strings(self.data, self.pos, count)
            else:
                for _ in range(count):
                    self.skip(item)
        elif kind in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[kind])
        else:
            raise HeaderError(f"unknown GGUF value type {kind}")


def _skip_strings(data: bytes, pos: int, count: int) -> int:
    """The offset past `count` strings from `pos` (past the data's end where it ends early: checked after)."""
    unpack, end = _U64.unpack_from, len(data) - 8
    for _ in range(count):
        if pos > end:
            raise HeaderError("the header ends early", truncated=True)
        pos += 8 + unpack(data, pos)[0]
    return pos


def read_array(path: Path, info: ArrayInfo) -> list[Any]:
    """An array value as Python values, the items gguf's ReaderField.contents() gives: numbers as numpy's
    tolist() makes them, strings decoded as UTF-8 (strictly). Arrays of arrays are not read (ValueError)."""
    import numpy as np

    with open(path, "rb") as f:
        f.seek(info.offset)
        if info.item_type in _SCALARS:
            fmt = _SCALARS[info.item_type]
            data = f.read(struct.calcsize(fmt) * info.count)
            return np.frombuffer(data, dtype=np.dtype(fmt.replace("?", "b1")), count=info.count).tolist()
        if info.item_type != 8:
            raise ValueError(f"GGUF arrays of value type {info.item_type} are not read here")
        out, data, pos, step = [], b"", 0, 1 << 20
        unpack = _U64.unpack_from
        for _ in range(info.count):
            if pos + 8 > len(data):  # read on in steps: the array's size is only known by walking it
                data, pos = data[pos:] + f.read(step), 0
            n = unpack(data, pos)[0]
            if pos + 8 + n > len(data):
                data, pos = data[pos:] + f.read(max(step, n + 8)), 0
                if 8 + n > len(data):
                    raise HeaderError("an array ends past the file's end", truncated=True)
            out.append(data[pos + 8 : pos + 8 + n].decode("utf-8"))
            pos += 8 + n
        return out


def read_header(path: Path) -> Header:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    with open(path, "rb") as f:
        data = f.read(min(size, 1 << 20))
        cur = _Cursor(data)
        if cur.take("<4s") != b"GGUF":
            raise HeaderError("no GGUF magic bytes")
        version = cur.take("<I")
        if version not in (2, 3):
            raise HeaderError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_keys = cur.take("<Q"), cur.take("<Q")
        header = Header()
        while True:  # the header may outgrow the first read (a large vocabulary): read it all then
            try:
                cur.pos = 24
                header = Header()
                for _ in range(n_keys):
                    key, kind = cur.string(), cur.take("<I")
                    header.keys.append(key)
                    if kind == 8:
                        header.fields[key] = cur.string()
                    elif kind == 9:
                        at = cur.pos
                        cur.skip(kind)
                        header.arrays[key] = ArrayInfo(*struct.unpack_from("<IQ", cur.data, at), at + 12)
                    elif kind in _SCALARS:
                        header.fields[key] = cur.take(_SCALARS[kind])
                    else:
                        raise HeaderError(f"unknown GGUF value type {kind}")
                infos = []
                for _ in range(n_tensors):
                    name, dims = cur.string(), cur.take("<I")
                    shape = tuple(cur.take("<Q") for _ in range(dims))
                    infos.append((name, shape, cur.take("<I"), cur.take("<Q")))
                if cur.pos > len(cur.data):
                    raise HeaderError("the header ends early", truncated=True)
                break
            except HeaderError as e:
                if not e.truncated or len(cur.data) >= size:
                    raise
                f.seek(0)
                cur.data = f.read(min(size, 4 * len(cur.data)))  # only the header: never the weights
    alignment = int(header.fields.get("general.alignment", 32))
    start = -(-cur.pos // alignment) * alignment
    for name, shape, kind, offset in infos:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError as e:
            raise HeaderError(f"tensor {name!r} has an unknown type {kind}", type_id=kind) from e
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        count = 1
        for d in shape:
            count *= d
        n_bytes = count // block * block_bytes
        if start + offset + n_bytes > size:
            raise HeaderError(f"tensor {name!r} ends past the file's end", truncated=True)
        header.tensors.append(TensorInfo(name, qtype.name, shape, start + offset, n_bytes))
    return header


def vocab_size(path: Path) -> int:
    """The number of tokens in a GGUF file's vocabulary, from the header alone (gguf's reader takes seconds)."""
    return read_header(Path(path)).arrays["tokenizer.ggml.tokens"].count


__all__ = ["ArrayInfo", "Header", "HeaderError", "TensorInfo", "read_array", "read_header", "vocab_size"]
