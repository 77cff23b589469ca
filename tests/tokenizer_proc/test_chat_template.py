"""--chat-template: the template chat requests use instead of the tokenizer's
own; and a model with no template at all (the Gemma 3 base model) answers chat
with a 400 that names the flag, while its other routes work."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.messages import ModelInfo
from common.server_args import ServerArgs
from tests.tokenizer_proc.samples import GEMMA_CHAT
from tests.tokenizer_proc.server_harness import Server, post
from tokenizer_proc.errors import BadRequestError
from tokenizer_proc.openai_protocol import parse_chat_request, parse_completion_request
from tokenizer_proc.tokenizer import NO_CHAT_TEMPLATE, NoChatTemplateError, Tokenizer, load_tokenizer

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def untemplated_folder(hf_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny HF tokenizer with no chat template, as a base model's is."""
    folder = tmp_path_factory.mktemp("no_template")
    shutil.copy(hf_folder / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    return folder


def info_for(tok: Tokenizer) -> ModelInfo:
    return ModelInfo(model_path="", tokenizer_path="", served_model_name="test", context_len=256,
                     max_total_tokens=4096, vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids,
                     dtype="float32", device="cpu", kv_cache_bytes=0)


def test_the_flag_replaces_the_tokenizers_own_template(hf_folder: Path) -> None:
    own = load_tokenizer(str(hf_folder))
    flagged = load_tokenizer(str(hf_folder), chat_template=GEMMA_CHAT.replace("{{ bos_token }}", ""))
    assert own.decode(own.apply_chat_template(HI), skip_special_tokens=False).startswith("<|im_start|>user")
    assert flagged.decode(flagged.apply_chat_template(HI), skip_special_tokens=False) == (
        "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")


def test_a_template_file_given_to_the_server_is_the_one_chat_uses(untemplated_folder: Path,
                                                                     tmp_path: Path) -> None:
    """What tokenizer_proc's main does: ServerArgs reads the file, the tokenizer applies it."""
    path = tmp_path / "chat.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]",
                    encoding="utf-8")
    args = ServerArgs(model_path="unused", chat_template=str(path))
    tok = load_tokenizer(str(untemplated_folder), args.chat_template_text())
    body = {"messages": [{"role": "system", "content": "Be brief."}, *HI], "max_tokens": 4}
    ids = parse_chat_request(body, tok, info_for(tok)).specs[0].req.input_ids
    assert tok.decode(ids) == "[system] Be brief.\n[user] hi\n[assistant]"


def test_without_a_template_chat_is_a_400_naming_the_flag(untemplated_folder: Path) -> None:
    tok = load_tokenizer(str(untemplated_folder))
    with pytest.raises(NoChatTemplateError):
        tok.apply_chat_template(HI)
    with pytest.raises(BadRequestError) as e:
        parse_chat_request({"messages": HI}, tok, info_for(tok))
    assert e.value.status == 400 and e.value.message == NO_CHAT_TEMPLATE
    assert "--chat-template" in NO_CHAT_TEMPLATE


def test_without_a_template_prompts_and_token_ids_still_work(untemplated_folder: Path) -> None:
    tok = load_tokenizer(str(untemplated_folder))
    info = info_for(tok)
    assert parse_completion_request({"prompt": "hi", "max_tokens": 2}, tok, info).specs[0].req.input_ids \
        == tok.encode("hi")
    # SGLang's input_ids on chat skip the template, so they need none
    chat = parse_chat_request({"messages": HI, "input_ids": [5, 6, 7], "max_tokens": 2}, tok, info)
    assert chat.specs[0].req.input_ids == [5, 6, 7]


@pytest.fixture(scope="module")
def untemplated_server(untemplated_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(load_tokenizer(str(untemplated_folder)), tmp_path_factory.mktemp("ipc"))
    yield srv
    srv.stop()


def test_the_chat_route_answers_400_and_the_server_keeps_serving(untemplated_server: Server) -> None:
    status, _, body = post(untemplated_server, {"model": "test", "messages": HI}, "/v1/chat/completions")
    assert status == 400
    assert json.loads(body) == {"error": {"message": NO_CHAT_TEMPLATE, "type": "BadRequestError", "code": 400}}
    status, _, body = post(untemplated_server, {"model": "test", "prompt": "hi", "max_tokens": 2}, "/v1/completions")
    assert status == 200, body


def test_a_template_that_does_not_parse_fails_the_start(hf_folder: Path) -> None:
    with pytest.raises(ValueError, match="--chat-template does not parse"):
        load_tokenizer(str(hf_folder), chat_template="{% for m in messages %}{{ m['content'] }")


def test_a_sentencepiece_tokenizer_refuses_the_flag(sp_folder: Path) -> None:
    with pytest.raises(ValueError, match="--chat-template needs a Hugging Face tokenizer"):
        load_tokenizer(str(sp_folder), chat_template=GEMMA_CHAT)
