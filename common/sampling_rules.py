"""The ranges of the sampling parameters: one rule set, applied by both
processes. The tokenizer process refuses a request that breaks one (a 400
that names the field as the client spelled it); the scheduler checks again,
as it never trusts a peer, so no value the model's int64 and float tensors
cannot take reaches a step."""

from __future__ import annotations

from common.messages import SamplingParams

MAX_TOP_K = 2**31 - 1
MAX_TOKEN_ID = 2**31 - 1  # stop_token_ids, stream_interval
MAX_SEED = 2**63 - 1  # a request's seed is an int64 (-1 in a ForwardBatch means unseeded)
MAX_LOGIT_BIAS = 1e9  # |bias| above this cannot change a choice any more, and keeps logits finite in float32
# token_ids_logprob: ids per request, as many as top_logprobs_num may ask for
# (the answer holds one value per id per position)
MAX_TOKEN_IDS_LOGPROB = 100


def sampling_error(sp: SamplingParams, vocab_size: int | None = None, prefix: str = "",
                   names: dict[str, str] | None = None, max_seed: int = MAX_SEED) -> str | None:
    """What is out of range in `sp` (None: nothing). `prefix` and `names`
    name the fields as the client spelled them (OpenAI's max_tokens...);
    `max_seed` is lower for a seed that n samples will share (seed + k).
    Written `not lo <= x <= hi`, so a NaN is out of every range."""
    def name(field: str) -> str:
        return prefix + (names or {}).get(field, field)

    # 0 is SGLang's prefill-only request (its frontend's select and prefix
    # caching send it): prompt logprobs and a warm cache, no output token
    if not sp.max_new_tokens >= 0:
        return f"{name('max_new_tokens')} must be >= 0"
    if not sp.temperature >= 0:
        return f"{prefix}temperature must be >= 0"
    if not 0 < sp.top_p <= 1:
        return f"{prefix}top_p must be in (0, 1]"
    if not -1 <= sp.top_k <= MAX_TOP_K:
        return f"{prefix}top_k must be -1 or 0 (both: off), or in [1, {MAX_TOP_K}]"
    if sp.seed is not None and not 0 <= sp.seed <= max_seed:
        return f"{prefix}seed must be in [0, {max_seed}]"
    if not 0 <= sp.min_p <= 1:
        return f"{prefix}min_p must be in [0, 1]"
    if any(not 0 <= i <= MAX_TOKEN_ID for i in sp.stop_token_ids):
        return f"{prefix}stop_token_ids must be in [0, {MAX_TOKEN_ID}]"
    for field in ("frequency_penalty", "presence_penalty"):
        if not -2 <= getattr(sp, field) <= 2:
            return f"{prefix}{field} must be in [-2, 2]"
    if not 0 < sp.repetition_penalty <= 2:
        return f"{prefix}repetition_penalty must be in (0, 2] (1 is no penalty)"
    if not 0 <= sp.min_new_tokens <= sp.max_new_tokens:
        max_name = (names or {}).get("max_new_tokens", "max_new_tokens")
        return f"{name('min_new_tokens')} must be in [0, {max_name}] (here [0, {sp.max_new_tokens}])"
    if sp.grammar is not None and sp.min_new_tokens > 0:
        # the grammar may allow only the stop token, which min_new_tokens forbids
        return (f"{name('min_new_tokens')} cannot be combined with a grammar "
                "(json_schema, regex, ebnf, response_format)")
    if any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in sp.logit_bias.values()):
        return f"{prefix}logit_bias: biases must be in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in sp.logit_bias):
        return f"{prefix}logit_bias: token ids must be in [0, {vocab_size})"
    if sp.stream_interval is not None and not 1 <= sp.stream_interval <= MAX_TOKEN_ID:
        return f"{prefix}stream_interval must be in [1, {MAX_TOKEN_ID}]"
    return None


def token_ids_logprob_error(ids: list[int], vocab_size: int, name: str = "token_ids_logprob") -> str | None:
    """SGLang's token_ids_logprob (the ids whose logprobs a request wants at
    each position): at most MAX_TOKEN_IDS_LOGPROB, each in the vocabulary."""
    if len(ids) > MAX_TOKEN_IDS_LOGPROB:
        return f"{name}: at most {MAX_TOKEN_IDS_LOGPROB} token ids (got {len(ids)})"
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"{name}: token id {bad} is out of the vocabulary [0, {vocab_size})"
    return None
