"""A GGUF file's metadata and tensor index, read as llama.cpp's gguf_init
reads them (little-endian, versions 2 and 3).

Why not gguf-py's GGUFReader: it builds a numpy view per metadata element,
which for SmolLM2's 49,152-token vocabulary took 5.3 s of every model
process's start and for Gemma 3's 262,144 tokens 15 to 40 s; this parses
the same bytes with `struct` in well under a second. Tensor data is not read
here: `GGUFFile.tensor_bytes` maps one tensor's bytes when asked.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

# metadata value types (ggml's gguf_type) -> struct format; 8 is a string, 9 an array
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's byte count, before its bytes
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF's order: the innermost (contiguous) dimension first
    ggml_type: int
    offset: int  # from the start of the data section


class _Cursor:
    """Reads values off a buffer; IndexError when one runs past its end."""

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf = buf
        self.pos = pos

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise IndexError("past the buffer")
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise IndexError("string past the buffer")
        text = self.buf[self.pos:self.pos + n].decode("utf-8")
        self.pos += n
        return text

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row: string() inlined, since a vocabulary's
        arrays hold ~100,000 of them (the default model's: 0.66 -> 0.2 s)."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        length = _LENGTH.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise IndexError("string past the buffer")
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > end:
                raise IndexError("string past the buffer")
            out.append(buf[pos:pos + n].decode("utf-8"))
            pos += n
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = self.unpack("<IQ")
            if elem in _SCALAR_FORMATS:
                return list(self.unpack(f"<{count}{_SCALAR_FORMATS[elem]}"))
            if elem == _STRING:
                return self.strings(count)
            return [self.value(elem) for _ in range(count)]
        if kind not in _SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF metadata value type {kind}")
        return self.unpack(f"<{_SCALAR_FORMATS[kind]}")[0]


class GGUFFile:
    """`metadata`: the key-value section (arrays as lists); `tensors`: the
    tensor index by GGUF name."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            magic, version = struct.unpack("<4sI", f.read(8))
            if magic != b"GGUF" or version not in (2, 3):
                raise ValueError(f"{path}: not a GGUF file of version 2 or 3 (magic {magic!r}, version {version})")
            # the header sits before the data; read in growing pieces until it is all in
            size = 1 << 24
            while True:
                f.seek(0)
                buf = f.read(size)
                try:
                    self._parse(buf)
                    break
                except IndexError:
                    if len(buf) < size:
                        raise ValueError(f"{path}: the GGUF header is cut short") from None
                    size *= 4

    def _parse(self, buf: bytes) -> None:
        cur = _Cursor(buf, 8)
        n_tensors, n_kv = cur.unpack("<QQ")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            (kind,) = cur.unpack("<I")
            self.metadata[key] = cur.value(kind)
        self.tensors: dict[str, TensorInfo] = {}
        for _ in range(n_tensors):
            name = cur.string()
            (n_dims,) = cur.unpack("<I")
            shape = cur.unpack(f"<{n_dims}Q")
            ggml_type, offset = cur.unpack("<IQ")
            self.tensors[name] = TensorInfo(name, tuple(int(d) for d in shape), int(ggml_type), int(offset))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_offset = -(-cur.pos // align) * align

    def tensor_bytes(self, info: TensorInfo, nbytes: int) -> np.ndarray:
        """The `nbytes` bytes of one tensor, mapped from the file (read-only)."""
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.data_offset + info.offset, shape=(nbytes,))
