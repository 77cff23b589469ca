"""Tool calls in generated text, one module per format, chosen by name
(`--tool-call-parser`, SGLang's names)."""

from __future__ import annotations

from tokenizer_proc.tool_calls.base import ToolCallParser
from tokenizer_proc.tool_calls.hermes import HermesParser, Qwen25Parser
from tokenizer_proc.tool_calls.llama3 import Llama3Parser
from tokenizer_proc.tool_calls.mistral import MistralParser
from tokenizer_proc.tool_calls.pythonic import PythonicParser

PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p for p in (HermesParser, Qwen25Parser, Llama3Parser, MistralParser, PythonicParser)}


def parser_class(name: str) -> type[ToolCallParser]:
    return PARSERS[name]
