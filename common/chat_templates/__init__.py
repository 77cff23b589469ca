"""Chat templates this server ships, by name (`--chat-template NAME`), and
which one renders tools for a model family whose own template does not.

A model's own template is used for tools when it handles them (its source
names `tools`); otherwise a request with tools, or with tool calls in its
history, is rendered with the shipped template of the model's family (told
by the special tokens its template writes). The tool-call format a template
teaches implies the parser that reads the calls back.
"""

from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))

SHIPPED: dict[str, str] = {"chatml-tools": "chatml-tools.jinja"}
# family marker in a template's source -> the shipped template with tools
FAMILY_TOOL_TEMPLATES: dict[str, str] = {"<|im_start|>": "chatml-tools"}
# the call format a template writes -> the --tool-call-parser that reads it
IMPLIED_PARSERS: dict[str, str] = {"<tool_call>": "hermes", "<|python_tag|>": "llama3",
                                   "[TOOL_CALLS]": "mistral"}


def shipped_template(name: str) -> str:
    with open(os.path.join(_HERE, SHIPPED[name]), encoding="utf-8") as f:
        return f.read()


def handles_tools(source: str) -> bool:
    return "tools" in source


def tool_template_for(source: str | None) -> str | None:
    """The template that renders tools for a model whose template is `source`:
    itself when it handles tools, else its family's shipped one, else None."""
    if not source:
        return None
    if handles_tools(source):
        return source
    for marker, name in FAMILY_TOOL_TEMPLATES.items():
        if marker in source:
            return shipped_template(name)
    return None


def implied_parser(source: str | None) -> str | None:
    """The parser for the call format `source` teaches, if it names one."""
    for marker, parser in IMPLIED_PARSERS.items():
        if source and marker in source:
            return parser
    return None
