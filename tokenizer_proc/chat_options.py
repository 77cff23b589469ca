"""A chat request's options about the template and the reasoning, as vLLM
and SGLang name them: `chat_template_kwargs` (variables for the template,
e.g. Qwen3's `enable_thinking`), `continue_final_message` (complete the last,
assistant, message instead of opening a new turn), `separate_reasoning`
(SGLang's: split the thinking into `reasoning_content`; default true when
the server has a --reasoning-parser) and `thinking_budget` (the most thinking
tokens before the server closes the block)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenizer_proc.errors import BadRequestError
from tokenizer_proc.validation import check_bool, check_int, optional

# Arguments of transformers' apply_chat_template: a template variable of the
# same name would set one of them instead (tokenize, add_generation_prompt, ...).
_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                       "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
                       "sanitize_control_tokens"})


@dataclass
class ChatOptions:
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    continue_final: bool = False
    separate_reasoning: bool | None = None  # None: as the server's --reasoning-parser says
    thinking_budget: int | None = None

    @property
    def template_defaults(self) -> bool:
        """The template is applied as it is without options."""
        return not self.template_kwargs and not self.continue_final


def check_chat_options(body: dict[str, Any], roles: list[str]) -> ChatOptions:
    """`roles`: the messages' roles, in order."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise BadRequestError("chat_template_kwargs must be an object of template variables")
    bad = next((k for k in kwargs if not k.isidentifier() or k in _RESERVED or k.startswith("_")), None)
    if bad is not None:
        raise BadRequestError(f"chat_template_kwargs: {bad[:60]!r} cannot be a template variable "
                              "(not a name, or an argument of the template call itself)")
    continue_final = optional(body, "continue_final_message", check_bool, False)
    if continue_final and (not roles or roles[-1] != "assistant"):
        raise BadRequestError("continue_final_message needs the last message to be the assistant's "
                              "(the text to continue)")
    if continue_final and body.get("add_generation_prompt") is True:
        raise BadRequestError("continue_final_message and add_generation_prompt cannot both be true")
    budget = optional(body, "thinking_budget", check_int, None)
    if budget is not None and budget < 0:
        raise BadRequestError("thinking_budget must be >= 0")
    return ChatOptions(template_kwargs=kwargs, continue_final=continue_final,
                       separate_reasoning=optional(body, "separate_reasoning", check_bool, None),
                       thinking_budget=budget)

