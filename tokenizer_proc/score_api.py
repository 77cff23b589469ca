"""SGLang's `POST /v1/score`: for each item, the probabilities of the label
tokens at the position right after query + item (or item + query with
`item_first`), e.g. P("Yes") and P("No") for a yes/no question about each item.

Body (SGLang's ScoringRequest): `query` (text or token ids), `items` (a text,
a list of texts, or a list of token id lists: the same kind as the query),
`label_token_ids`, `apply_softmax` (false: each label's probability in the
whole vocabulary; true: normalized over the labels), `item_first`.
Answer: `{"scores": [[p per label] per item], "model", "object": "scoring",
"usage"}`.

Each item is one request that generates a single token (greedy) with
`token_ids_logprob` = the labels: the logprobs the model computes for that
token's position are the scores (the path /generate's token_ids_logprob
takes; tokenizer_proc/logprobs.py). Texts are joined before tokenizing, as
SGLang does. Items share the query's prefix in the prefix cache.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from aiohttp import web

from common.messages import FinishAbort, SamplingParams, TokenizedGenerateReq
from common.sampling_rules import token_ids_logprob_error
from tokenizer_proc.app_keys import MANAGER, MODEL_INFO, PROMPT_CHAR_LIMIT, SERVER_ARGS, TOKENIZER, TOKENIZER_POOL
from tokenizer_proc.errors import BadRequestError, json_response
from tokenizer_proc.finish_json import abort_error
from tokenizer_proc.generation import Generation
from tokenizer_proc.middlewares import read_body
from tokenizer_proc.openai_api import served_model_name
from tokenizer_proc.protocol import MAX_OUTPUTS, check_fits_context, check_prompt_ids
from tokenizer_proc.request_spec import RequestSpec, fan_out_rids
from tokenizer_proc.tokenizer import Tokenizer
from tokenizer_proc.validation import check_bool, check_prompt_chars, is_int, optional, parse_json_object

Prompt = str | list[int]


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(is_int(t) for t in v)


def _items(query: Any, items: Any) -> list[Prompt]:
    """The items, checked to be of the query's kind (text or ids)."""
    if isinstance(query, str):
        found = [items] if isinstance(items, str) else items
        if not isinstance(found, list) or not found or not all(isinstance(i, str) for i in found):
            raise BadRequestError("items must be a text or a non-empty list of texts when the query is a text")
    elif _is_ids(query) and query:
        found = items
        if not isinstance(found, list) or not found or not all(_is_ids(i) and i for i in found):
            raise BadRequestError("items must be a non-empty list of token id lists when the query is token ids")
    else:
        raise BadRequestError("query must be a text or a non-empty list of token ids")
    if len(found) > MAX_OUTPUTS:
        raise BadRequestError(f"at most {MAX_OUTPUTS} items per request")
    return found


def _joined(query: Prompt, item: Prompt, item_first: bool) -> Prompt:
    return item + query if item_first else query + item  # type: ignore[operator]


def _encode(tokenizer: Tokenizer, prompts: list[Prompt], vocab: int) -> list[list[int]]:
    return [check_prompt_ids(tokenizer.encode(p) if isinstance(p, str) else p, vocab) for p in prompts]


def scores_from_logprobs(logprobs: list[float], apply_softmax: bool) -> list[float]:
    """Probabilities of the labels: each exp(logprob), or a softmax over them."""
    if not apply_softmax:
        return [math.exp(lp) for lp in logprobs]
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


async def score(request: web.Request) -> web.Response:
    arrival = time.perf_counter()
    app = request.app
    info, tokenizer = app[MODEL_INFO], app[TOKENIZER]
    body = parse_json_object(await read_body(request))
    labels = body.get("label_token_ids")
    if not _is_ids(labels) or not labels:
        raise BadRequestError("label_token_ids must be a non-empty list of token ids")
    error = token_ids_logprob_error(labels, info.vocab_size, "label_token_ids")
    if error is not None:
        raise BadRequestError(error)
    query = body.get("query")
    items = _items(query, body.get("items"))
    item_first = optional(body, "item_first", check_bool, False)
    apply_softmax = optional(body, "apply_softmax", check_bool, False)
    prompts = [_joined(query, item, item_first) for item in items]
    for k, p in enumerate(prompts):
        if isinstance(p, str):
            check_prompt_chars(f"items[{k}] with the query", p, app[PROMPT_CHAR_LIMIT])
    ids = await app[TOKENIZER_POOL].run(_encode, tokenizer, prompts, info.vocab_size)
    for p in ids:
        check_fits_context(len(p), 1, info.context_len)
    request_id = f"score-{uuid.uuid4().hex}"
    specs = [RequestSpec(TokenizedGenerateReq(
        rid=rid, input_ids=p, sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
        return_logprob=True, token_ids_logprob=list(labels)), group=request_id if len(ids) > 1 else None)
        for rid, p in zip(fan_out_rids(request_id, len(ids)), ids)]
    gen = Generation(app[MANAGER], tokenizer, specs, False, arrival, app[SERVER_ARGS].max_logprob_entries)
    gen.submit()
    try:
        await gen.wait()
    finally:
        gen.abort()  # a no-op unless the client went away or something failed
    scores = []
    for out in gen.outputs:
        if isinstance(out.finish_reason, FinishAbort):
            raise abort_error(out.finish_reason)
        scores.append(scores_from_logprobs(out.token_ids_logprobs[0], apply_softmax))
    prompt_tokens = sum(len(p) for p in ids)
    return json_response({"scores": scores, "model": served_model_name(app), "object": "scoring",
                          "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                                    "total_tokens": prompt_tokens}})
