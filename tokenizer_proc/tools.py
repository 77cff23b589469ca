"""A chat request's tools: `tools`, `tool_choice`, `parallel_tool_calls`, and
the tool turns of its history, checked before anything runs.

What a request asks for becomes a `ToolRequest`: the tools, how they may be
called (`ToolChoice`), and the parser of the server's tool-call format.
Its grammar (xgrammar's structural tag, built by the parser's format) makes
every call that starts a call that parses: with "required" or a named
function the output is calls only (one, or several with
parallel_tool_calls), with "auto" free text in which the format's trigger
opens a call whose name and arguments are then constrained to a tool's.
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
from dataclasses import dataclass
from typing import Any

from common.messages import Grammar, GrammarKind
from common.server_args import ServerArgs
from tokenizer_proc.errors import BadRequestError
from tokenizer_proc.grammar import GrammarLimits, grammar_error
from tokenizer_proc.tool_calls import PARSERS
from tokenizer_proc.tool_calls.base import ToolCallParser
from tokenizer_proc.tool_calls.spec import ToolSpec

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for function names (dots too, as vLLM)
MAX_TOOLS = 128  # OpenAI's limit


class ToolChoice(enum.Enum):
    NONE = "none"  # no calls: the tools are not shown to the model and nothing is parsed
    AUTO = "auto"  # text, calls, or both, as the model chooses
    REQUIRED = "required"  # calls only, at least one
    NAMED = "named"  # calls only, of one named function


@dataclass(frozen=True)
class ToolRequest:
    tools: list[ToolSpec]
    raw: list[dict[str, Any]]  # the tools as sent (the chat template renders them)
    choice: ToolChoice
    named: str | None  # NAMED: the function
    parallel: bool
    parser: type[ToolCallParser]

    @property
    def active(self) -> bool:
        """Calls are possible: the output is parsed and constrained."""
        return self.choice is not ToolChoice.NONE

    def callable_tools(self) -> list[ToolSpec]:
        return [t for t in self.tools if self.named is None or t.name == self.named]

    def grammar(self) -> Grammar:
        forced = self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)
        tag = {"type": "structural_tag",
               "format": self.parser.structural_tag(self.callable_tools(), forced, self.parallel)}
        return Grammar(GrammarKind.STRUCTURAL_TAG, json.dumps(tag, separators=(",", ":")))

    def new_parser(self) -> ToolCallParser:
        return self.parser([t.name for t in self.callable_tools()])


def _tool(k: int, tool: Any) -> tuple[ToolSpec, dict[str, Any]]:
    where = f"tools[{k}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise BadRequestError(f"{where} must be an object of type \"function\" (the only tool type served)")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise BadRequestError(f"{where}.function must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadRequestError(f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or '-'")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise BadRequestError(f"{where}.function.description must be a string")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise BadRequestError(f"tool {name!r}: parameters must be a JSON schema object")
    if params.get("type", "object") != "object":
        raise BadRequestError(f"tool {name!r}: parameters must describe an object (type \"object\"), "
                              "as a call's arguments are one")
    raw = {"type": "function", "function": {"name": name, "description": description, "parameters": params}}
    return ToolSpec(name, params, description), raw


def _tool_choice(value: Any, names: list[str]) -> tuple[ToolChoice, str | None]:
    if value is None:
        return (ToolChoice.AUTO if names else ToolChoice.NONE), None
    if isinstance(value, str):
        try:
            choice = ToolChoice(value)
        except ValueError:
            choice = ToolChoice.NAMED  # "named" is ours, not a value clients send
        if choice is ToolChoice.NAMED:
            raise BadRequestError("tool_choice must be \"none\", \"auto\", \"required\" or "
                                  "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if choice is ToolChoice.REQUIRED and not names:
            raise BadRequestError("tool_choice \"required\" needs tools")
        return choice, None
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequestError("tool_choice must be \"none\", \"auto\", \"required\" or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if fn["name"] not in names:
        known = ", ".join(names) if names else "none given"
        raise BadRequestError(f"tool_choice names the function {fn['name']!r}, which is not among the tools "
                              f"({known})")
    return ToolChoice.NAMED, fn["name"]


def tool_request(body: dict[str, Any], parser_name: str | None) -> ToolRequest | None:
    """The request's tools and how they may be called; None without tools."""
    tools, choice_value = body.get("tools"), body.get("tool_choice")
    if tools is None and choice_value in (None, "none", "auto"):
        return None
    if tools is None:
        tools = []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequestError(f"tools must be a list of at most {MAX_TOOLS} function tools")
    specs, raw = [], []
    for k, t in enumerate(tools):
        spec, r = _tool(k, t)
        if any(s.name == spec.name for s in specs):
            raise BadRequestError(f"tools[{k}]: the function name {spec.name!r} is given twice")
        specs.append(spec)
        raw.append(r)
    choice, named = _tool_choice(choice_value, [s.name for s in specs])
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise BadRequestError("parallel_tool_calls must be a boolean")
    if not specs:
        return None
    if choice is not ToolChoice.NONE:
        for field_name in ("response_format", "json_schema", "regex", "ebnf"):
            value = body.get(field_name)
            if value is not None and not (field_name == "response_format" and isinstance(value, dict)
                                          and value.get("type") == "text"):
                raise BadRequestError(f"tools (tool_choice {choice_value or 'auto'!r}) cannot be combined with "
                                      f"{field_name}: the tool calls' grammar is the request's one grammar "
                                      "(use tool_choice \"none\" to keep the tools out)")
        if parser_name is None:
            raise BadRequestError("this server cannot read tool calls for its chat template: start it with "
                                  "--tool-call-parser")
    return ToolRequest(specs, raw, choice, named, parallel, PARSERS[parser_name or "hermes"])


async def check_tool_schemas(req: ToolRequest, args: ServerArgs) -> None:
    """A 400 naming the first tool whose parameters are not a JSON schema the
    grammar compiler takes (or are over a size bound); off the event loop."""
    limits = GrammarLimits.from_args(args)
    loop = asyncio.get_running_loop()
    for tool in req.tools:
        error = await loop.run_in_executor(None, grammar_error,
                                           Grammar(GrammarKind.JSON_SCHEMA, json.dumps(tool.parameters)), limits)
        if error is not None:
            raise BadRequestError(f"tool {tool.name!r}: parameters is not a valid JSON schema: "
                                  f"{error.removeprefix('invalid json_schema: ')}")


# ---- the history ----------------------------------------------------------------------


def assistant_tool_calls(calls: Any, k: int, known: dict[str, str]) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, for the template (arguments as an
    object, as templates expect); each id is remembered in `known`."""
    if not isinstance(calls, list):
        raise BadRequestError(f"messages[{k}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{k}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(call.get("id"), str):
            raise BadRequestError(f"{where} must have a string id and a function with a name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise BadRequestError(f"{where}.function.arguments is not JSON") from None
        if not isinstance(args, dict):
            raise BadRequestError(f"{where}.function.arguments must be a JSON object")
        known[call["id"]] = fn["name"]
        out.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def tool_result(m: dict[str, Any], k: int, known: dict[str, str], content: str) -> dict[str, Any]:
    """A `tool` message: its call must be one of an earlier assistant turn's."""
    call_id = m.get("tool_call_id")
    if not isinstance(call_id, str):
        raise BadRequestError(f"messages[{k}]: a tool message needs a string tool_call_id")
    if call_id not in known:
        raise BadRequestError(f"messages[{k}].tool_call_id {call_id!r} matches no earlier assistant tool call")
    return {"role": "tool", "content": content, "tool_call_id": call_id, "name": known[call_id]}
