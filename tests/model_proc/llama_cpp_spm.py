"""llama.cpp's SentencePiece tokenizer (`llm_tokenizer_spm`, a GGUF whose
tokenizer.ggml.model is "llama"), in Python over the GGUF's own vocabulary:
the reference the converted tokenizer must encode as. Written from llama.cpp's
algorithm, not from transformers' converter, so the two are independent."""

from __future__ import annotations

import heapq

from model_proc.quant.gguf_file import GGUFFile

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class LlamaCppSpm:
    def __init__(self, gguf_path: str) -> None:
        fields = GGUFFile(gguf_path).metadata
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
