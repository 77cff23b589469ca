"""llama.cpp's SentencePiece tokenizer (`llm_tokenizer_spm`, a GGUF whose
tokenizer.ggml.model is "llama"), in Python over the GGUF's own vocabulary:
the reference the converted tokenizer must encode as. Written from llama.cpp's
algorithm, not from transformers' converter, so the two are independent."""

from __future__ import annotations

import heapq
import struct
from typing import Any

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# GGUF metadata value types (ggml's gguf_type) -> struct format; 8 is a
# string, 9 an array
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


def read_gguf_metadata(gguf_path: str) -> dict[str, Any]:
    """The key-value section of a (little-endian, version 2 or 3) GGUF file,
    read as llama.cpp's gguf_init does; arrays become lists. Why not gguf's
    GGUFReader: it builds a numpy view per element, which for Gemma's 262,144
    tokens takes 15 to 40 s on 2 cores; this takes well under a second."""
    with open(gguf_path, "rb") as f:
        head = f.read(24)
        magic, version, _, n_kv = struct.unpack("<4sIQQ", head)
        assert magic == b"GGUF" and version in (2, 3), (magic, version)
        # the metadata sits before the tensor infos; read in growing pieces until it is all in
        size = 1 << 24
        while True:
            f.seek(0)
            buf = f.read(size)
            try:
                return _parse_kv(buf, n_kv)
            except (struct.error, IndexError):
                if len(buf) < size:
                    raise
                size *= 4


def _parse_kv(buf: bytes, n_kv: int) -> dict[str, Any]:
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        if pos + 8 + n > len(buf):
            raise IndexError("string past the buffer")
        text = buf[pos + 8:pos + 8 + n].decode("utf-8")
        pos += 8 + n
        return text

    def value(kind: int) -> Any:
        nonlocal pos
        if kind == STRING:
            return string()
        if kind == ARRAY:
            elem, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if elem in SCALAR_FORMATS:
                fmt = SCALAR_FORMATS[elem]
                items = list(struct.unpack_from(f"<{count}{fmt}", buf, pos))
                pos += count * struct.calcsize(fmt)
                return items
            return [value(elem) for _ in range(count)]
        fmt = SCALAR_FORMATS[kind]
        (v,) = struct.unpack_from(f"<{fmt}", buf, pos)
        pos += struct.calcsize(fmt)
        return v

    fields = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        fields[key] = value(kind)
    return fields


class LlamaCppSpm:
    def __init__(self, gguf_path: str) -> None:
        fields = read_gguf_metadata(gguf_path)
        assert fields["tokenizer.ggml.model"] == "llama"
        self.tokens: list[str] = fields["tokenizer.ggml.tokens"]
        self.scores = [float(s) for s in fields["tokenizer.ggml.scores"]]
        types = [int(t) for t in fields["tokenizer.ggml.token_type"]]
        self.bos = int(fields["tokenizer.ggml.bos_token_id"])
        self.add_bos = bool(fields["tokenizer.ggml.add_bos_token"])
        self.add_space_prefix = bool(fields["tokenizer.ggml.add_space_prefix"])
        self.id_of = {t: i for i, t in enumerate(self.tokens)}
        # matched whole before the merges, longest first (tokenizer_st_partition;
        # control tokens too: parse_special, as llama-server tokenizes prompts)
        self.specials = sorted((t for t, ty in zip(self.tokens, types) if ty in (CONTROL, USER_DEFINED)),
                               key=len, reverse=True)

    def encode(self, text: str) -> list[int]:
        ids = [self.bos] if self.add_bos else []
        for frag, special in self._partition(text):
            ids += [self.id_of[frag]] if special else self._merge(frag)
        return ids

    def _partition(self, text: str) -> list[tuple[str, bool]]:
        frags = [(text, False)]
        for tok in self.specials:
            out: list[tuple[str, bool]] = []
            for frag, special in frags:
                if special or tok not in frag:
                    out.append((frag, special))
                    continue
                parts = frag.split(tok)
                for k, part in enumerate(parts):
                    if part:
                        out.append((part, False))
                    if k < len(parts) - 1:
                        out.append((tok, True))
            frags = out
        return frags

    def _merge(self, text: str) -> list[int]:
        """Merge the adjacent pair whose joined piece scores highest (the
        leftmost on a tie) until none is in the vocabulary; then each symbol is
        its token, or its merge's halves, or its UTF-8 bytes (byte fallback)."""
        if self.add_space_prefix:
            text = " " + text
        sym: list[str | None] = list(text.replace(" ", "\u2581"))
        prev = list(range(-1, len(sym) - 1))
        nxt = list(range(1, len(sym) + 1))
        heap: list[tuple[float, int, int, str]] = []
        halves: dict[str, tuple[str, str]] = {}

        def add(left: int, right: int) -> None:
            if left < 0 or right >= len(sym):
                return
            a, b = sym[left], sym[right]
            assert a is not None and b is not None
            i = self.id_of.get(a + b)
            if i is not None:
                heapq.heappush(heap, (-self.scores[i], left, right, a + b))
                halves[a + b] = (a, b)

        for k in range(len(sym) - 1):
            add(k, k + 1)
        while heap:
            _, left, right, joined = heapq.heappop(heap)
            a, b = sym[left], sym[right]
            if a is None or b is None or nxt[left] != right or a + b != joined:
                continue  # stale: a side has merged since
            sym[left], sym[right] = joined, None
            nxt[left] = nxt[right]
            if nxt[right] < len(sym):
                prev[nxt[right]] = left
            add(prev[left], left)
            add(left, nxt[left])

        out: list[int] = []

        def emit(piece: str) -> None:
            if piece in self.id_of:
                out.append(self.id_of[piece])
            elif piece in halves:
                for half in halves[piece]:
                    emit(half)
            else:
                out.extend(self.id_of[f"<0x{b:02X}>"] for b in piece.encode("utf-8"))

        for piece in sym:
            if piece is not None:
                emit(piece)
        return out
