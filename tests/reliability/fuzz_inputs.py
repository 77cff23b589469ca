"""A seeded generator of bad (and a few good) HTTP requests for the fuzz test.

Each case is plain data (method, path, headers, body bytes), so a failure can
be printed exactly and replayed. Bodies are random bytes, random JSON values,
or valid request bodies with a few fields swapped for awkward values (wrong
types, huge or negative numbers, empty strings and lists, odd unicode), which
is where validation bugs live.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

GENERATION_ROUTES = [("POST", "/generate"), ("POST", "/v1/completions"),
                     ("POST", "/v1/chat/completions")]
ROUTES = [
    ("POST", "/abort_request"), ("POST", "/flush_cache"), ("GET", "/flush_cache"),
    ("GET", "/health"), ("GET", "/health_generate"), ("GET", "/get_model_info"),
    ("GET", "/get_server_info"), ("GET", "/v1/models"), ("GET", "/v1/models/some-model"),
    ("GET", "/metrics"), ("GET", "/no/such/route"),
    ("GET", "/timeline?limit=%C2%B2"), ("GET", "/timeline?after_seq=" + "9" * 400),
]
OTHER_METHODS = ["PUT", "DELETE", "PATCH", "OPTIONS", "POST", "GET"]

AWKWARD: list[Any] = [
    None, True, False, 0, 1, -1, 2, 3, 7, 64, 100, 101, 128, 129, 2**31, 2**53 + 1, 2**63 - 1,
    2**63, 2**64 - 1, 2**64, 2**100, -2**63, -2**63 - 1, -2**64, 0.0, -0.0, 0.5, 1.0, 1.5, 2.0,
    2.5, 1e-9, 5e-324, 1e308, -1e308, -0.5, "", "a", "1", "0.5", "true", "null", "\u0000",
    "\ud800", "\U0001f600" * 3, "<|im_end|>", "x" * 5000, [], [1], [0, 1, 2], [-1], [2**64],
    [[1, 2]], [[]], ["a", "b"], [None], {}, {"a": 1}, {"type": "text"},
    list(range(200)), ["Hello", "World"],
    10**400, -10**400, "\u00b2", {"\u00b2": 1.0}, {"1" * 5000: 1.0}, {"5": 10**400},
]
# JSON texts json.dumps cannot produce (non-standard numbers, overflow)
RAW_JSON_SNIPPETS = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" * 400, "0x10", "01"]
NESTING_DEPTHS = [129, 1_000, 5_000, 100_000]  # past the front end's bound, and past Python's recursion

GENERATE_FIELDS = ["text", "input_ids", "sampling_params", "stream", "rid", "return_logprob",
                   "top_logprobs_num", "logprob_start_len", "return_text_in_logprobs", "extra"]
SAMPLING_FIELDS = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                   "stop_token_ids", "ignore_eos", "skip_special_tokens", "n", "seed", "bogus",
                   "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias"]
OPENAI_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens",
                 "temperature", "top_p", "n", "stream", "stream_options", "stop", "logprobs",
                 "top_logprobs", "seed", "frequency_penalty", "presence_penalty", "logit_bias",
                 "echo", "best_of", "suffix", "user", "response_format", "tools", "tool_choice",
                 "top_k", "min_p", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                 "repetition_penalty", "timeout"]
MESSAGE_FIELDS = ["role", "content", "name"]


@dataclass
class Case:
    method: str
    path: str
    body: bytes
    headers: dict[str, str]
    chunked: bool = False  # send the body with Transfer-Encoding: chunked

    def describe(self) -> str:
        shown = self.body[:600]
        more = f" ... ({len(self.body)} bytes)" if len(self.body) > 600 else ""
        return (f"{self.method} {self.path} headers={self.headers} chunked={self.chunked} "
                f"body={shown!r}{more}")


def valid_body(path: str) -> dict[str, Any]:
    """A request each route accepts, small enough to run in a blink."""
    if path == "/generate":
        return {"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    if path == "/v1/completions":
        return {"model": "m", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
    if path == "/v1/chat/completions":
        return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    if path == "/abort_request":
        return {"rid": "no-such-request"}
    return {}


def random_json(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 3 or r < 0.5:
        return rng.choice(AWKWARD)
    if r < 0.75:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = GENERATE_FIELDS + OPENAI_FIELDS + ["", "\u00e9"]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def mutate(rng: random.Random, body: dict[str, Any], path: str) -> dict[str, Any]:
    """Sets, nests or deletes one to three fields."""
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        r = rng.random()
        if path == "/generate" and r < 0.45:
            sp = body.get("sampling_params")
            if not isinstance(sp, dict):
                sp = body["sampling_params"] = {}
            sp[rng.choice(SAMPLING_FIELDS)] = rng.choice(AWKWARD)
        elif path == "/v1/chat/completions" and r < 0.3:
            msg = {f: rng.choice(AWKWARD + ["user", "system", "assistant", "tool"])
                   for f in rng.sample(MESSAGE_FIELDS, rng.randint(0, 3))}
            body["messages"] = rng.choice([[msg], [msg, {"role": "user", "content": "x"}], msg])
        elif r < 0.9:
            fields = GENERATE_FIELDS if path == "/generate" else OPENAI_FIELDS + ["rid", "abort_all"]
            body[rng.choice(fields)] = random_json(rng)
        elif body:
            body.pop(rng.choice(sorted(body)))
    return body


def sampling_value(rng: random.Random, name: str) -> Any:
    """A value for a sampling field: usually in its valid range, sometimes at
    or past its edges, sometimes of the wrong type."""
    if rng.random() < 0.15:
        return rng.choice(AWKWARD)
    return {
        "max_new_tokens": lambda: rng.randint(1, 6),
        "max_tokens": lambda: rng.randint(1, 6),
        "temperature": lambda: rng.choice([0, 0.0, 1e-7, rng.uniform(0, 2), 1e30]),
        "top_p": lambda: rng.choice([1.0, rng.uniform(0, 1), 1e-30, 5e-324]),
        "top_k": lambda: rng.choice([-1, 0, 1, rng.randint(1, 100), 49152, 2**31, 2**62, 2**63]),
        "min_p": lambda: rng.choice([0.0, rng.uniform(0, 1), 1.0]),
        "seed": lambda: rng.choice([0, rng.randint(0, 2**31), 2**62, 2**63 - 1, 2**63, 2**64 - 1]),
        "stop": lambda: rng.choice(["\n", ["the", "."], ["a"] * 3, "\U0001f600", "<|im_end|>"]),
        "stop_token_ids": lambda: [rng.randrange(0, 49152) for _ in range(rng.randint(0, 3))],
        "n": lambda: rng.randint(1, 3),
        "ignore_eos": lambda: rng.random() < 0.5,
        "skip_special_tokens": lambda: rng.random() < 0.5,
        "logprobs": lambda: rng.random() < 0.5,
        "top_logprobs": lambda: rng.randint(0, 20),
    }.get(name, lambda: rng.choice(AWKWARD))()


def random_sampling(rng: random.Random, path: str) -> dict[str, Any]:
    """A mostly plausible request with random sampling parameters."""
    body = valid_body(path)
    if path == "/generate":
        names = [f for f in SAMPLING_FIELDS if f != "bogus"]
        body["sampling_params"] = {f: sampling_value(rng, f) for f in names if rng.random() < 0.5}
        body["sampling_params"].setdefault("max_new_tokens", rng.randint(1, 6))
        if rng.random() < 0.3:
            body["return_logprob"] = True
            body["top_logprobs_num"] = rng.choice([0, 1, 5, 100])
        body["stream"] = rng.random() < 0.3
    else:
        names = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "stop_token_ids", "n", "ignore_eos", "skip_special_tokens", "logprobs",
                 "top_logprobs"]
        body.update({f: sampling_value(rng, f) for f in names if rng.random() < 0.5})
        body["stream"] = rng.random() < 0.3
    return body


def dumps(rng: random.Random, obj: Any) -> bytes:
    text = json.dumps(obj, ensure_ascii=rng.random() < 0.5)
    if rng.random() < 0.1:  # a non-standard number where a value was
        text = text.replace("3", rng.choice(RAW_JSON_SNIPPETS), 1)
    return text.encode("utf-8", "surrogatepass")


def deeply_nested(rng: random.Random, path: str) -> bytes:
    """JSON nested past every bound: the whole body, or one field of a valid body."""
    depth = rng.choice(NESTING_DEPTHS)
    opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
    inner = opener * depth + "1" + closer * depth
    if rng.random() < 0.5:
        return inner.encode()
    return json.dumps({**valid_body(path), "x": "NEST"}).replace('"NEST"', inner).encode()


def make_case(rng: random.Random) -> Case:
    # half the cases go where the validation is
    method, path = rng.choice(GENERATION_ROUTES if rng.random() < 0.5 else ROUTES)
    if rng.random() < 0.05:
        method = rng.choice(OTHER_METHODS)
    headers = {"Content-Type": rng.choice(["application/json", "text/plain", "",
                                           "application/json; charset=latin-1"])}
    r = rng.random()
    if r < 0.15:
        body = rng.randbytes(rng.randint(0, 3000))
    elif r < 0.3:
        body = dumps(rng, random_json(rng))
    elif r < 0.33:
        body = b""
    elif r < 0.35:
        body = deeply_nested(rng, path)
    elif r < 0.7 and path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        body = dumps(rng, random_sampling(rng, path))
    else:
        body = dumps(rng, mutate(rng, valid_body(path), path))
    return Case(method=method, path=path, body=body, headers=headers, chunked=rng.random() < 0.1)
