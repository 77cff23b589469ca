"""One benchmark request against one backend, timed token by token.

- `sglang`: POST /generate; SSE events carry the cumulative text and
  `meta_info.completion_tokens`, so a chunk's token count is exact.
- `openai`: POST /v1/completions; `openai-chat`: POST /v1/chat/completions.
  Chunks carry text deltas; token counts come from `usage` (asked for with
  `stream_options.include_usage`). A chunk is taken as one token, which holds
  for servers that stream every token (ours with --stream-interval 1).

Greedy decoding (temperature 0) everywhere, so reruns of a trace do the same work.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import aiohttp

from bench.lib.datasets import DatasetRow
from bench.lib.metrics import RequestResult

BACKENDS = ("sglang", "openai", "openai-chat")
UNKNOWN = -1  # a token count the server did not report


@dataclass(frozen=True)
class RequestConfig:
    backend: str
    base_url: str  # http://host:port, no trailing slash
    model: str = ""  # the OpenAI "model" field
    stream: bool = True
    ignore_eos: bool = True  # exact output lengths: the trace's, not the model's whim
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body
    api_key: str = ""


def prompt_text(prompt: str | list[int], decode: Any) -> str:
    return prompt if isinstance(prompt, str) else decode(prompt)


def build_request(cfg: RequestConfig, row: DatasetRow, decode: Any, max_tokens: int | None = None
                  ) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) for one row; `decode` turns ids into text where a
    backend only takes text (chat messages)."""
    n_out = max_tokens if max_tokens is not None else row.output_len
    if cfg.backend == "sglang":
        body: dict[str, Any] = {"input_ids" if isinstance(row.prompt, list) else "text": row.prompt,
                                "sampling_params": {"max_new_tokens": n_out, "temperature": 0.0,
                                                    "ignore_eos": cfg.ignore_eos},
                                "stream": cfg.stream}
        path = "/generate"
    elif cfg.backend in ("openai", "openai-chat"):
        body = {"model": cfg.model, "max_tokens": n_out, "temperature": 0.0, "stream": cfg.stream}
        if cfg.ignore_eos:
            body["ignore_eos"] = True  # SGLang's extension, which our server accepts
        if cfg.stream:
            body["stream_options"] = {"include_usage": True}
        if cfg.backend == "openai":
            body["prompt"] = row.prompt  # our server also takes token ids here
            path = "/v1/completions"
        else:
            body["messages"] = [{"role": "user", "content": prompt_text(row.prompt, decode)}]
            path = "/v1/chat/completions"
    else:
        raise ValueError(f"unknown backend {cfg.backend!r}; one of {', '.join(BACKENDS)}")
    body.update(cfg.extra_body)
    return path, body


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an SSE body, up to `data: [DONE]`."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[len(b"data:"):].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)


class TokenClock:
    """Turns 'n tokens so far, now' observations into TTFT and ITL."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.last_time = start
        self.count = 0
        self.ttft: float | None = None
        self.itl: list[float] = []

    def saw(self, count: int, now: float) -> None:
        new = count - self.count
        if new <= 0:
            return
        if self.ttft is None:
            self.ttft = now - self.start  # tokens that came with the first are not gaps
        else:
            self.itl.extend([(now - self.last_time) / new] * new)
        self.count, self.last_time = count, now


def _error_of(obj: dict[str, Any]) -> str | None:
    err = obj.get("error")
    if err is None:
        return None
    return err.get("message", str(err)) if isinstance(err, dict) else str(err)


async def send_request(session: aiohttp.ClientSession, cfg: RequestConfig, row: DatasetRow,
                       decode: Any, max_tokens: int | None = None) -> RequestResult:
    path, body = build_request(cfg, row, decode, max_tokens)
    res = RequestResult(client_prompt_len=row.prompt_len,
                        expected_output_len=max_tokens if max_tokens is not None else row.output_len)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    res.start = time.perf_counter()
    try:
        async with session.post(cfg.base_url + path, json=body, headers=headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return res
            if cfg.stream:
                await _read_stream(cfg.backend, resp, res)
            else:
                _read_whole(cfg.backend, await resp.json(), res)
                res.ttft = res.latency = time.perf_counter() - res.start
    except (aiohttp.ClientError, ValueError, KeyError, TypeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.success = not res.error
    return res


async def _read_stream(backend: str, resp: aiohttp.ClientResponse, res: RequestResult) -> None:
    clock = TokenClock(res.start)
    chunks = 0
    res.output_len = UNKNOWN
    async for ev in sse_events(resp):
        now = time.perf_counter()
        if (err := _error_of(ev)) is not None:
            res.error = err
            return
        if backend == "sglang":
            meta = ev["meta_info"]
            clock.saw(meta["completion_tokens"], now)
            res.generated_text = ev["text"]
            res.prompt_len, res.output_len = meta["prompt_tokens"], meta["completion_tokens"]
            res.cached_tokens = meta.get("cached_tokens", 0)
            reason = meta.get("finish_reason") or {}
            if reason.get("type") == "abort":
                res.error = f"aborted: {reason.get('message')}"
                return
            continue
        choices = ev.get("choices") or []
        delta = ""
        if choices:
            c = choices[0]
            delta = c.get("text") if backend == "openai" else (c.get("delta") or {}).get("content")
            delta = delta or ""
        if delta:
            chunks += 1
            clock.saw(chunks, now)
            res.generated_text += delta
        if ev.get("usage"):
            _read_usage(ev["usage"], res)
    if clock.ttft is None:
        clock.ttft = time.perf_counter() - res.start  # nothing visible came (all special tokens)
    res.ttft, res.itl = clock.ttft, clock.itl
    res.latency = time.perf_counter() - res.start  # to the end of the stream, as SGLang


def _read_whole(backend: str, obj: Any, res: RequestResult) -> None:
    if isinstance(obj, dict) and (err := _error_of(obj)) is not None:
        res.error = err
        return
    if backend == "sglang":
        meta = obj["meta_info"]
        res.generated_text = obj["text"]
        res.prompt_len, res.output_len = meta["prompt_tokens"], meta["completion_tokens"]
        res.cached_tokens = meta.get("cached_tokens", 0)
        return
    c = obj["choices"][0]
    res.generated_text = c.get("text") if backend == "openai" else c["message"].get("content") or ""
    _read_usage(obj.get("usage") or {}, res)


def _read_usage(usage: dict[str, Any], res: RequestResult) -> None:
    """OpenAI's usage; cached prompt tokens are in prompt_tokens_details where a server reports them."""
    res.prompt_len = usage.get("prompt_tokens", 0)
    res.output_len = usage.get("completion_tokens", UNKNOWN)
    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
