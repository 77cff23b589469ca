from __future__ import annotations

from pathlib import Path

import pytest

from tests.tokenizer_proc.samples import TEXT
from tokenizer_proc.detokenizer import IncrementalDetokenizer
from tokenizer_proc.tokenizer import Tokenizer, load_tokenizer


def stream(tok: Tokenizer, ids: list[int], chunk: int, skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens)
    pieces = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text
    return pieces


def check_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    for chunk in (1, 2, 3, 5, len(ids)):
        pieces = stream(tok, ids, chunk)
        assert "".join(pieces) == tok.decode(ids) == text, chunk
        assert not any("\ufffd" in p for p in pieces), (chunk, pieces)


@pytest.fixture(params=["sentencepiece", "hf"])
def tokenizer(request: pytest.FixtureRequest, sp_model_file: Path, hf_folder: Path) -> Tokenizer:
    return load_tokenizer(str(sp_model_file if request.param == "sentencepiece" else hf_folder))


def test_round_trip_multibyte(tokenizer: Tokenizer) -> None:
    check_round_trip(tokenizer, TEXT)
    check_round_trip(tokenizer, "🦀🦀 Ж\n\nline two 東京")


def test_holds_back_split_character(sp_model_file: Path) -> None:
    tok = load_tokenizer(str(sp_model_file))
    ids = tok.encode("🦀")  # not in the training corpus: four byte tokens
    detok = IncrementalDetokenizer(tok)
    out = [detok.add([i]) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "🦀"


def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_ids[0]
    ids = tokenizer.encode("ok café") + [eos] + tokenizer.encode("🙂 again")
    for skip in (True, False):
        for chunk in (1, 2):
            text = "".join(stream(tokenizer, ids, chunk, skip))
            assert text == tokenizer.decode(ids, skip_special_tokens=skip)


def test_flush_emits_incomplete_tail(sp_model_file: Path) -> None:
    tok = load_tokenizer(str(sp_model_file))
    ids = tok.encode("🦀")[:-1]  # generation stopped mid-character
    pieces = stream(tok, ids, 1)
    assert "".join(pieces) == tok.decode(ids)
    assert pieces[-1].endswith("\ufffd")  # only the final flush may carry one


def test_round_trip_smollm2(default_model_dir: str) -> None:
    check_round_trip(load_tokenizer(default_model_dir), TEXT + " “quotes”  two  spaces \n")


class CountingTokenizer:
    """Records how many ids each decode call gets."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.sizes = tok, []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens)


def test_the_decode_window_stays_short_whatever_the_tokens(sp_model_file: Path) -> None:
    """20k tokens that never make text (skipped special tokens) or never make a
    character (stray bytes): each step decodes a few tokens, not the output so far."""
    from tokenizer_proc.detokenizer import MAX_HELD_TOKENS

    tok = load_tokenizer(str(sp_model_file))
    stray = tok.sp.piece_to_id("<0x80>")  # a UTF-8 continuation byte alone
    eos = tok.eos_token_ids[0]
    head, tail = tok.encode("ok"), tok.encode(" again")[1:]
    for filler in (eos, stray):
        ids = head + [filler] * 20_000 + tail
        counting = CountingTokenizer(tok)
        detok = IncrementalDetokenizer(counting)  # type: ignore[arg-type]
        text = "".join(detok.add([i]) for i in ids) + detok.flush()
        assert max(counting.sizes) <= 2 * MAX_HELD_TOKENS + 8, max(counting.sizes)
        assert text == tok.decode(ids), filler


def test_appending_a_token_to_a_long_output_copies_only_the_new_text(sp_model_file: Path) -> None:
    """RequestOutput keeps its text in pieces: one more token allocates about
    its own text, not the whole output (20k tokens in)."""
    import tracemalloc

    from common.messages import SamplingParams, TokenizedGenerateReq
    from tokenizer_proc.manager import ReqState
    from tokenizer_proc.request_output import RequestOutput
    from tokenizer_proc.request_spec import RequestSpec

    tok = load_tokenizer(str(sp_model_file))
    word = tok.encode(" hello")[1:]
    for stop in ([], ["never seen"]):
        state = ReqState(rid="r", prompt_tokens=1, arrival=0.0)
        spec = RequestSpec(TokenizedGenerateReq(rid="r", input_ids=[1], sampling_params=SamplingParams()), stop=stop)
        out = RequestOutput(state, spec, tok)
        for _ in range(20_000):
            state.output_ids.extend(word)
            out.update()
        assert out.text_len > 100_000 and out.text.startswith("hello hello")
        assert out.text_since(out.text_len - 12) == " hello hello"
        tracemalloc.start()
        try:
            state.output_ids.extend(word)
            out.update()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 20_000, peak  # the text is over 100 kB
