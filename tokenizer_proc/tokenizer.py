"""One small tokenizer interface over the two formats models ship with.

- Hugging Face fast tokenizers (a folder holding tokenizer.json), through
  transformers' AutoTokenizer, local files only.
- SentencePiece `tokenizer.model` files, wrapped directly: they load in
  milliseconds and need no transformers conversion step.

The HTTP process calls `encode` and `apply_chat_template` through a
`TokenizerPool`, on worker threads: a prompt of megabytes then delays its own
request, not the event loop that streams everyone else's tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from common.chat_templates import SHIPPED, implied_parser, tool_template_for
from common.tokenizer_files import find_tokenizer, load_hf_tokenizer

T = TypeVar("T")

NO_CHAT_TEMPLATE = ("this model has no chat template (its tokenizer carries none): start the server with "
                    "--chat-template FILE, or send the prompt as text to /v1/completions or /generate")


NO_TOOL_TEMPLATE = ("this model's chat template does not render tools, and no template this server ships fits "
                    f"its family: start the server with --chat-template FILE (or one of {', '.join(SHIPPED)})")


class NoChatTemplateError(ValueError):
    """A chat request to a model without a chat template (or, with tools, without
    one that renders them): the client's to fix (HTTP 400)."""

    def __init__(self, message: str = NO_CHAT_TEMPLATE) -> None:
        super().__init__(message)


def uses_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """The request needs a template that renders tools: tools given, or calls in its history."""
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


class Tokenizer(Protocol):
    eos_token_ids: list[int]
    vocab_size: int
    # the most characters one token stands for (its vocabulary entry's length):
    # a prompt longer than context length x this cannot fit, whatever its tokens
    max_token_chars: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt, with the BOS token the model expects (none
        without add_special_tokens)."""
        ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    # the parser of the tool-call format the chat template teaches (hermes, ...), or None
    implied_tool_parser: str | None

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                            continue_final: bool = False, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt ids for a chat, ending with the assistant's turn opener; with
        `tools` (OpenAI's tool objects) the template lists them; with
        `continue_final`, ending inside the last (assistant) message instead, to
        be completed. `template_kwargs`: variables for the template (e.g.
        enable_thinking)."""
        ...


class TokenizerPool:
    """Worker threads for tokenizer calls, so none runs on the event loop.

    Hugging Face's fast tokenizers release the GIL while they encode (a 1 MB
    prompt: ~0.5 s on a thread, the loop's longest pause ~10 ms); a chat
    template is Python and shares the GIL, which switches every 5 ms. Two
    workers: one huge prompt does not hold up every other request's
    tokenization, and the machine's cores stay with the model."""

    def __init__(self, workers: int = 2) -> None:
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenize")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def load_tokenizer(path: str, chat_template: str | None = None) -> Tokenizer:
    """A folder with tokenizer.json is a HF fast tokenizer; a folder with only
    tokenizer.model (or a .model file itself) is SentencePiece. `chat_template`
    (--chat-template's Jinja source) replaces the tokenizer's own."""
    kind, found = find_tokenizer(path)
    if kind == "sentencepiece":
        if chat_template:  # its chat format is Llama 2's, written in Python: no Jinja renderer
            raise ValueError(f"--chat-template needs a Hugging Face tokenizer (tokenizer.json); {found} "
                             "is a SentencePiece model")
        return SentencePieceTokenizer(found)
    return HFTokenizer(found, chat_template)


class HFTokenizer:
    def __init__(self, path: str, chat_template: str | None = None) -> None:
        self.tok = load_hf_tokenizer(path)
        if chat_template:
            self.tok.chat_template = chat_template
            _check_template_syntax(self.tok)
        own = getattr(self.tok, "chat_template", None)
        self.tool_template = tool_template_for(own if isinstance(own, str) else None)
        self.implied_tool_parser = implied_parser(self.tool_template)
        self.vocab_size = len(self.tok)  # includes added (special) tokens
        self.eos_token_ids = _eos_ids(self.tok.eos_token_id, path)
        # byte-level entries have a character per byte, so this bounds the
        # characters of the decoded token too
        self.max_token_chars = max(len(t) for t in self.tok.get_vocab())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The tokenizer's own default decides BOS (Llama adds it, SmolLM does not).
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                            continue_final: bool = False, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            raise NoChatTemplateError()
        extra: dict[str, Any] = {}
        if uses_tools(messages, tools):
            if self.tool_template is None:
                raise NoChatTemplateError(NO_TOOL_TEMPLATE)
            extra = {"chat_template": self.tool_template, "tools": tools or None}
        # Render to text and encode without special tokens: the template already
        # writes any BOS itself. (tokenize=True returns a BatchEncoding in
        # transformers 5 and a list in 4; text works in both.) continue_final:
        # transformers renders without the generation prompt and cuts the text
        # after the last message's content.
        prompt = self.tok.apply_chat_template(messages, add_generation_prompt=not continue_final,
                                              continue_final_message=continue_final, tokenize=False,
                                              **{**(template_kwargs or {}), **extra})
        return list(self.tok.encode(prompt, add_special_tokens=False))


def _check_template_syntax(tok: Any) -> None:
    """A --chat-template that does not parse fails the start, not every chat request."""
    import jinja2

    try:
        tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not parse: {e.message} (line {e.lineno})") from None
    except Exception:  # the template's own checks may refuse a lone user turn: not a syntax error
        pass


def _eos_ids(tokenizer_eos: int | None, folder: str) -> list[int]:
    """The tokenizer's EOS plus generation_config.json's (Llama 3 has several)."""
    ids = [] if tokenizer_eos is None else [tokenizer_eos]
    gen_cfg = os.path.join(folder, "generation_config.json")
    if os.path.exists(gen_cfg):
        with open(gen_cfg) as f:
            extra = json.load(f).get("eos_token_id")
        for i in extra if isinstance(extra, list) else [extra]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


class SentencePieceTokenizer:
    def __init__(self, model_file: str) -> None:
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id: int = self.sp.bos_id()  # -1 when the model has none
        self.eos_token_ids = [self.sp.eos_id()] if self.sp.eos_id() >= 0 else []
        self.max_token_chars = max(len(self.sp.id_to_piece(i)) for i in range(self.vocab_size))
        self.implied_tool_parser: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return (self._bos() if add_special_tokens else []) + self.sp.encode(text)

    def _bos(self) -> list[int]:
        return [self.bos_id] if self.bos_id >= 0 else []

    def _is_special(self, i: int) -> bool:
        return self.sp.is_control(i) or self.sp.is_unknown(i)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [i for i in ids if 0 <= i < self.vocab_size]  # padded model vocab
        if skip_special_tokens:
            return self.sp.decode([i for i in ids if not self._is_special(i)])
        # SentencePiece renders control tokens as "", so write their pieces
        # ourselves between runs of ordinary tokens.
        parts: list[str] = []
        run: list[int] = []
        for i in ids + [-1]:  # -1: sentinel that closes the last run
            if i >= 0 and not self._is_special(i):
                run.append(i)
                continue
            if run:
                text = self.sp.decode(run)
                # decode() drops the word-start space of a run's first piece;
                # keep it when the run is not at the start of the text.
                if parts and self.sp.id_to_piece(run[0]).startswith("\u2581"):
                    text = " " + text
                parts.append(text)
                run = []
            if i >= 0:
                parts.append(self.sp.id_to_piece(i))
        return "".join(parts)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                            continue_final: bool = False, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Llama 2's [INST] format: each finished exchange is
        `<s>[INST] user [/INST] answer </s>`; a system prompt goes inside the
        first user turn. continue_final: the last (assistant) answer is left
        open. template_kwargs: no template variables here (a Jinja template
        ignores those it does not use, as this format does). It has no tools."""
        if uses_tools(messages, tools):
            raise NoChatTemplateError(NO_TOOL_TEMPLATE)
        msgs = [dict(m) for m in messages]
        final = msgs.pop() if continue_final else None
        if msgs and msgs[0].get("role") == "system":
            system = msgs.pop(0)["content"]
            if not msgs or msgs[0].get("role") != "user":
                raise ValueError("a system message must be followed by a user message")
            msgs[0]["content"] = f"<<SYS>>\n{system}\n<</SYS>>\n\n{msgs[0]['content']}"
        if not msgs or msgs[-1].get("role") != "user":
            raise ValueError("the last message must come from the user")
        ids: list[int] = []
        for k, m in enumerate(msgs):
            want = "user" if k % 2 == 0 else "assistant"
            if m.get("role") != want:
                raise ValueError("roles must alternate user/assistant (after an optional system)")
            content = str(m.get("content", "")).strip()
            if want == "user":
                ids += self._bos() + self.sp.encode(f"[INST] {content} [/INST]")
            else:
                ids += self.sp.encode(f" {content} ") + self.eos_token_ids[:1]
        if final is not None:
            ids += self.sp.encode(f" {str(final.get('content', '')).strip()}")
        return ids
