"""The shape of an OpenAI-style SSE stream, without its values: each chunk is
sorted into a kind (chat: role, content, finish, usage; completions: echo,
text, finish, usage) and reduced to a skeleton (its keys at every level and
the JSON types of its values), merged over the chunks of a kind. A
completions `top_logprobs` entry (a map token -> logprob) becomes
{"<token>": type}. Types met together read "float|null"; a value that is an
object or list in some chunks and null in others reads {"oneOf": [...]}.

Run as a script, it records the streams of REQUESTS from a running server and
prints their shapes as JSON (how tests/tokenizer_proc/data/vllm_stream_shapes.json
was made from vLLM):
    python -m tests.tokenizer_proc.stream_shape 8000 > shapes.json
"""

from __future__ import annotations

import http.client
import json
import sys
from functools import reduce
from typing import Any

MSG = [{"role": "user", "content": "Tell me a story."}]
PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3,"]
USAGE = {"include_usage": True}

# name -> (path, body, number of choices): issue 29 item 12's four requests, and chat whose
# choices can end on EOS (the fake scheduler's all do: its script is shorter than 64 tokens)
REQUESTS: dict[str, tuple[str, dict[str, Any], int]] = {
    "chat_n2_logprobs": ("/v1/chat/completions", {
        "messages": MSG, "n": 2, "temperature": 0.8, "seed": 0, "max_tokens": 8, "stream": True,
        "stream_options": USAGE, "logprobs": True, "top_logprobs": 2}, 2),
    "completions_3_prompts_n2_logprobs": ("/v1/completions", {
        "prompt": PROMPTS, "n": 2, "max_tokens": 6, "logprobs": 2, "stream": True, "stream_options": USAGE}, 6),
    "completions_3_prompts_n2_logprobs_echo": ("/v1/completions", {
        "prompt": PROMPTS, "n": 2, "max_tokens": 6, "logprobs": 2, "echo": True, "stream": True,
        "stream_options": USAGE}, 6),
    "chat_n1_no_usage": ("/v1/chat/completions", {
        "messages": MSG, "n": 1, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": False}}, 1),
    "chat_n2_logprobs_eos": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say hi."}], "n": 2, "max_tokens": 64, "temperature": 0.8,
        "seed": 0, "logprobs": True, "top_logprobs": 2, "stream": True, "stream_options": USAGE}, 2),
}


def sse_chunks(raw: bytes) -> list[dict[str, Any]]:
    """The JSON chunks of a whole SSE body that ends with `data: [DONE]`."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    parts = raw.split(b"\n\n")
    assert parts[-1] == b"" and all(p.startswith(b"data: ") for p in parts[:-1])
    return [json.loads(p[len(b"data: "):]) for p in parts[:-2]]


def skeleton(value: Any, key: str | None = None) -> Any:
    if key == "top_logprobs" and isinstance(value, dict) and "token" not in value:
        return {"<token>": reduce(merge, (skeleton(v) for v in value.values()))} if value else {}
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return [reduce(merge, (skeleton(v, key) for v in value))] if value else []
    return {k: skeleton(v, k) for k, v in value.items()}


def _alternatives(s: Any) -> list[Any]:
    return s["oneOf"] if isinstance(s, dict) and list(s) == ["oneOf"] else [s]


def _merge_dicts(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    keys = list(a) + [k for k in b if k not in a]
    return {k: merge(a.get(k, "absent"), b.get(k, "absent")) for k in keys}


def _merge_lists(a: list[Any], b: list[Any]) -> list[Any]:
    return [merge(a[0], b[0])] if a and b else a or b


def merge(a: Any, b: Any) -> Any:
    """One skeleton for two: keys missing on one side read "absent"."""
    if a == b:
        return a
    alts = _alternatives(a) + _alternatives(b)
    types = {t for x in alts if isinstance(x, str) for t in x.split("|")}
    dicts = [x for x in alts if isinstance(x, dict)]
    lists = [x for x in alts if isinstance(x, list)]
    out: list[Any] = []
    if types:
        out.append("|".join(sorted(types)))
    if dicts:
        out.append(reduce(_merge_dicts, dicts))
    if lists:
        out.append(reduce(_merge_lists, lists))
    return out[0] if len(out) == 1 else {"oneOf": out}


def chunk_kinds(chunks: list[dict[str, Any]], chat: bool, echo: bool) -> list[tuple[str, int | None]]:
    """(kind, choice index) per chunk; the usage chunk's index is None."""
    out: list[tuple[str, int | None]] = []
    seen: set[int] = set()
    for c in chunks:
        if not c["choices"]:
            out.append(("usage", None))
            continue
        choice = c["choices"][0]
        first = choice["index"] not in seen
        seen.add(choice["index"])
        if choice["finish_reason"] is not None:
            kind = "finish"
        elif chat and "role" in choice["delta"]:
            kind = "role"
        elif echo and first:
            kind = "echo"
        else:
            kind = "content" if chat else "text"
        out.append((kind, choice["index"]))
    return out


def per_index_pattern(kinds: list[tuple[str, int | None]]) -> dict[int, list[str]]:
    """Per choice, its chunks' kinds with runs collapsed ("content" twice or more reads "content+")."""
    runs: dict[int, list[str]] = {}
    for kind, index in kinds:
        if index is None:
            continue
        seq = runs.setdefault(index, [])
        if seq and seq[-1].rstrip("+") == kind:
            seq[-1] = kind + "+"
        else:
            seq.append(kind)
    return runs


def stream_shape(raw: bytes, path: str, body: dict[str, Any]) -> dict[str, Any]:
    chunks = sse_chunks(raw)
    chat = path.endswith("/chat/completions")
    kinds = chunk_kinds(chunks, chat, bool(body.get("echo")))
    shapes: dict[str, Any] = {}
    for (kind, _), chunk in zip(kinds, chunks):
        shapes[kind] = merge(shapes[kind], skeleton(chunk)) if kind in shapes else skeleton(chunk)
    patterns = per_index_pattern(kinds)
    lp_counts = sorted({len(c["choices"][0]["logprobs"]["content" if chat else "tokens"])
                        for c in chunks if c["choices"] and c["choices"][0].get("logprobs")})
    return {"objects": sorted({c["object"] for c in chunks}), "kinds": shapes, "index_order": [i for _, i in kinds if i is not None],
            "per_index": sorted({json.dumps(p) for p in patterns.values()}),
            "logprob_tokens_per_chunk": lp_counts,
            "usage_last": kinds[-1][0] == "usage" and [k for k, _ in kinds].count("usage") == 1}


def record(port: int) -> dict[str, Any]:
    def call(method: str, path: str, body: Any = None) -> bytes:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request(method, path, None if body is None else json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        assert resp.status == 200, (resp.status, data)
        return data

    model = json.loads(call("GET", "/v1/models"))["data"][0]["id"]
    return {name: {"path": path, "body": body, "choices": n,
                   **stream_shape(call("POST", path, {"model": model, **body}), path, body)}
            for name, (path, body, n) in REQUESTS.items()}


if __name__ == "__main__":
    json.dump(record(int(sys.argv[1])), sys.stdout, indent=1)
    print()
