"""Which request fields this server takes, field by field, in one place.

`/generate` takes every field of SGLang's `GenerateReqInput` (top level) and
`SamplingParams` (`sampling_params`), as of SGLang's io_struct.py and
sampling_params.py; `/v1/completions` and `/v1/chat/completions` take
OpenAI's fields and SGLang's extras. Each field is one of:

- implemented: honoured;
- ignored: accepted with any value, because it cannot change the answer (a
  routing hint, a label, a logging switch);
- default only: a feature this server does not have. Accepted at its
  null/default value (clients send those: SGLang's bench_serving sends
  `"lora_path": null`), refused with a 400 naming the field and why otherwise.

On /generate a name SGLang does not define is a 400 naming it; the OpenAI
routes ignore unknown names (OpenAI clients send many), as SGLang and vLLM do.

    python -m tokenizer_proc.sglang_fields    # the lists as Markdown (README.md has them)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.errors import BadRequestError

IMPLEMENTED, IGNORED, DEFAULT_ONLY = "implemented", "ignored", "default only"


@dataclass(frozen=True)
class Rule:
    status: str
    reason: str = ""  # default only: why another value is refused; ignored: why it does not matter
    accepted: tuple[Any, ...] = ()  # default only: values besides null (and empty) that are accepted


def _impl(note: str = "") -> Rule:
    return Rule(IMPLEMENTED, note)


def _ignored(reason: str) -> Rule:
    return Rule(IGNORED, reason)


def _default(reason: str, *accepted: Any) -> Rule:
    return Rule(DEFAULT_ONLY, reason, accepted)


TEXT_ONLY = _default("this server serves text models: no image, video or audio input")
NO_LORA = _default("LoRA adapters are not supported")
NO_DISAGG = _default("prefill/decode disaggregation is not supported")
ONE_DP_RANK = _default("this server has one data-parallel rank, 0", 0)
NO_STRUCTURAL_TAG = _default("structural tags are not supported (json_schema, regex and ebnf are)")
VLLM_GUIDED = _default("vLLM's guided decoding fields are not supported: use response_format, "
                       "or SGLang's json_schema, regex or ebnf")
NO_CUSTOM_LOGITS = _default("custom logit processors are not supported")
SGLANG_INTERNAL = _default("internal to SGLang: set by the server, not by clients")

# SGLang's GenerateReqInput, the /generate body.
GENERATE_FIELDS: dict[str, Rule] = {
    "text": _impl(), "input_ids": _impl(), "sampling_params": _impl("an object, or a list with one per prompt"),
    "rid": _impl(), "stream": _impl(), "return_logprob": _impl(), "top_logprobs_num": _impl(),
    "return_text_in_logprobs": _impl(), "cache_salt": _impl(),
    "extra_key": _impl("joins cache_salt: requests with different keys never share cached prefixes"),
    "logprob_start_len": _impl("with return_logprob: prompt logprobs from this position (-1: none)"),
    "priority": _impl("with --enable-priority-scheduling: larger first; ignored without it, as in SGLang"),
    "timeout": _impl("this server's: seconds from arrival; past it the request ends as an abort"),
    "token_ids_logprob": _impl("with return_logprob: these ids' logprobs at each output (and prompt) position"),
    "return_sampling_mask": _default("sampling masks are not returned", False),
    "return_flat_raw_top_logprobs": _default("flat raw top logprobs are not returned", False),
    "return_flat_raw_top_logprobs_b64": _default("flat raw top logprobs are not returned", False),
    "input_embeds": _default("input embeddings are not supported: send text or input_ids"),
    "image_data": TEXT_ONLY, "video_data": TEXT_ONLY, "audio_data": TEXT_ONLY, "mm_hashes": TEXT_ONLY,
    "mm_content_hashes": TEXT_ONLY, "use_audio_in_video": _default(TEXT_ONLY.reason, False),
    "video_config": TEXT_ONLY, "modalities": TEXT_ONLY, "need_wait_for_mm_inputs": TEXT_ONLY,
    "num_items_assigned": TEXT_ONLY, "encoder_urls": TEXT_ONLY, "max_dynamic_patch": TEXT_ONLY,
    "min_dynamic_patch": TEXT_ONLY, "image_max_dynamic_patch": TEXT_ONLY,
    "video_max_dynamic_patch": TEXT_ONLY, "images_config": TEXT_ONLY,
    "return_hidden_states": _default("hidden states are not returned", False),
    "return_routed_experts": _default("no mixture-of-experts routing to return", False),
    "routed_experts_start_len": _default("no mixture-of-experts routing to return", 0),
    "return_indexer_topk": _default("no sparse-attention indexer to return", False),
    "return_bytes": _default("image generation only", False),
    "return_entropy": _default("entropy is not returned", False),
    "return_prompt_token_ids": _default("prompt token ids are not returned", False),
    "session_params": _default("sessions (continual prompting) are not supported"),
    "lora_path": NO_LORA, "lora_id": NO_LORA,
    "custom_logit_processor": NO_CUSTOM_LOGITS,
    "positional_embed_overrides": _default("embedding overrides are not supported"),
    "bootstrap_host": NO_DISAGG, "bootstrap_port": NO_DISAGG, "bootstrap_room": NO_DISAGG,
    "bootstrap_pair_key": NO_DISAGG, "decode_tp_size": NO_DISAGG, "disagg_prefill_dp_rank": NO_DISAGG,
    "routed_dp_rank": ONE_DP_RANK, "data_parallel_rank": ONE_DP_RANK,
    "http_worker_ipc": SGLANG_INTERNAL,
    "background": _default("background responses are not supported", False),
    "require_reasoning": _default("not a hybrid reasoning model", False),
    "max_thinking_tokens": _default("not a reasoning model: there is no thinking budget"),
    "multi_item_delimiter_indices": _default("multi-item scoring is not supported"),
    "model": _ignored("this server serves one model; routers add the name"),
    "session_id": _ignored("a label: it does not change the prompt"),
    "log_metrics": _ignored("metrics are recorded for every request"),
    "no_logs": _ignored("request contents are never logged"),
    "custom_labels": _ignored("metrics carry no custom labels"),
    "routing_key": _ignored("a router's key"), "conversation_id": _ignored("a label"),
    "kv_router_hint": _ignored("a hint for a KV storage backend this server does not have"),
    "external_trace_header": _ignored("no tracing"),
    "received_time": _ignored("the server times requests from their arrival"),
}

# SGLang's SamplingParams, the /generate body's `sampling_params`.
SAMPLING_FIELDS: dict[str, Rule] = {
    "max_new_tokens": _impl(), "temperature": _impl(), "top_p": _impl(), "top_k": _impl(), "min_p": _impl(),
    "frequency_penalty": _impl(), "presence_penalty": _impl(), "repetition_penalty": _impl(),
    "min_new_tokens": _impl(), "logit_bias": _impl(), "stop": _impl(), "stop_token_ids": _impl(),
    "stop_regex": _impl(), "no_stop_trim": _impl(), "n": _impl(), "ignore_eos": _impl(),
    "skip_special_tokens": _impl(), "stream_interval": _impl(),
    "sampling_seed": _impl("SGLang's name for seed"), "seed": _impl("this server's name, kept"),
    "spaces_between_special_tokens": _default("special tokens are decoded as the tokenizer does", True),
    "json_schema": _impl("a JSON schema (JSON text; \"$$ANY$$\": any JSON value)"),
    "regex": _impl(), "ebnf": _impl("xgrammar's EBNF, root rule `root`"), "structural_tag": NO_STRUCTURAL_TAG,
    "custom_params": NO_CUSTOM_LOGITS,
    "stop_strs": SGLANG_INTERNAL, "stop_regex_strs": SGLANG_INTERNAL,
    "stop_str_max_len": _default(SGLANG_INTERNAL.reason, 0),
    "stop_regex_max_len": _default(SGLANG_INTERNAL.reason, 0),
    "is_normalized": _default(SGLANG_INTERNAL.reason, False),
}

# /v1/completions and /v1/chat/completions: OpenAI's fields and SGLang's (and
# vLLM's) extras. Unknown names are ignored.
OPENAI_FIELDS: dict[str, Rule] = {
    "model": _ignored("this server serves one model, and answers with its name"),
    "prompt": _impl("completions"), "messages": _impl("chat: text content"),
    "input_ids": _impl("chat: prompt ids instead of the chat template (SGLang's)"),
    "max_tokens": _impl(), "max_completion_tokens": _impl("chat"), "n": _impl(), "stream": _impl(),
    "stream_options": _impl("include_usage"), "temperature": _impl(), "top_p": _impl(), "seed": _impl(),
    "stop": _impl(), "logprobs": _impl(), "top_logprobs": _impl("chat"),
    "frequency_penalty": _impl(), "presence_penalty": _impl(), "logit_bias": _impl(),
    "top_k": _impl(), "min_p": _impl(), "min_tokens": _impl(), "repetition_penalty": _impl(),
    "stop_token_ids": _impl(), "stop_regex": _impl(), "no_stop_trim": _impl(), "ignore_eos": _impl(),
    "skip_special_tokens": _impl(), "cache_salt": _impl(), "extra_key": _impl(),
    "timeout": _impl("this server's: seconds from arrival; past it the request ends as an abort"),
    "best_of": _default("best_of other than n is not supported", 1),
    "echo": _impl("completions: the prompt (with logprobs, its tokens' logprobs) before the completion; "
                  "with max_tokens 0 the prompt alone"),
    "suffix": _default("suffix (insertion) is not supported"),
    "tools": _impl("chat: function tools (--tool-call-parser)"),
    "functions": _default("the deprecated functions field is not supported: use tools"),
    "function_call": _default("the deprecated function_call field is not supported: use tool_choice", "none"),
    "tool_choice": _impl("chat: none, auto, required, or a named function"),
    "response_format": _impl("text, json_object, json_schema (structural_tag is a 400)"),
    "json_schema": _impl("SGLang's"), "regex": _impl("SGLang's"), "ebnf": _impl("SGLang's"),
    "structural_tag": NO_STRUCTURAL_TAG,
    "guided_json": VLLM_GUIDED, "guided_regex": VLLM_GUIDED, "guided_choice": VLLM_GUIDED,
    "guided_grammar": VLLM_GUIDED, "guided_decoding_backend": VLLM_GUIDED, "structured_outputs": VLLM_GUIDED,
    "audio": _default("audio output is not supported"),
    "lora_path": NO_LORA,
    "session_params": _default("sessions (continual prompting) are not supported"),
    "custom_params": NO_CUSTOM_LOGITS, "custom_logit_processor": NO_CUSTOM_LOGITS,
    "continue_final_message": _impl("chat: complete the last, assistant, message instead of a new turn"),
    "chat_template_kwargs": _impl("chat: variables for the template (e.g. enable_thinking)"),
    "thinking_budget": _impl("chat: the most thinking tokens before the server closes the block"),
    "return_hidden_states": _default("hidden states are not returned", False),
    "return_routed_experts": _default("no mixture-of-experts routing to return", False),
    "routed_experts_start_len": _default("no mixture-of-experts routing to return", 0),
    "return_cached_tokens_details": _default(
        "only usage.prompt_tokens_details.cached_tokens is reported", False),
    "return_token_ids": _default("token ids are not returned on /v1/* (use /generate)", False),
    "return_prompt_token_ids": _default("prompt token ids are not returned", False),
    "return_meta_info": _default("meta_info is not returned on /v1/* (use /generate)", False),
    "images_config": TEXT_ONLY, "max_dynamic_patch": TEXT_ONLY, "min_dynamic_patch": TEXT_ONLY,
    "use_audio_in_video": _default(TEXT_ONLY.reason, False),
    "bootstrap_host": NO_DISAGG, "bootstrap_port": NO_DISAGG, "bootstrap_room": NO_DISAGG,
    "disagg_prefill_dp_rank": NO_DISAGG, "routed_dp_rank": ONE_DP_RANK, "data_parallel_rank": ONE_DP_RANK,
    "user": _ignored("a label"), "metadata": _ignored("a label"), "store": _ignored("nothing is stored"),
    "service_tier": _ignored("one tier"), "parallel_tool_calls": _impl("chat: false allows one call at most"),
    "prediction": _ignored("a speed hint: it does not change the answer"),
    "reasoning_effort": _ignored("no effort levels: chat_template_kwargs and thinking_budget steer thinking"),
    "separate_reasoning": _impl("chat, with --reasoning-parser: thinking in reasoning_content (default true)"),
    "stream_reasoning": _ignored("reasoning_content is always streamed as it comes"),
    "session_id": _ignored("a label: it does not change the prompt"),
    "rid": _ignored("the response's id names the request (and /abort_request takes it)"),
    "priority": _impl("with --enable-priority-scheduling, as on /generate"), "custom_labels": _ignored("metrics carry no custom labels"),
    "ngram_corpus_id": _ignored("no speculative decoding"),
}


def is_default(value: Any, rule: Rule) -> bool:
    """Null, empty (an empty string, list or object, or a list of nulls: SGLang's
    per-prompt form of null), or one of the rule's accepted values (same type:
    JSON's false is not 0)."""
    if value is None or value == "" or value == [] or value == {}:
        return True
    if isinstance(value, list) and all(v is None for v in value):
        return True
    return any(type(value) is type(a) and value == a for a in rule.accepted)


def check_fields(body: dict[str, Any], table: dict[str, Rule], prefix: str = "",
                 strict: bool = True, defined_by: str = "") -> None:
    """Raise a 400 for the first field set to a value this server cannot
    honour; with `strict`, also for a name the table does not know."""
    for name, value in body.items():
        rule = table.get(name)
        if rule is None:
            if strict:
                raise BadRequestError(f"unsupported field {prefix}{name}: not a field of {defined_by}")
            continue
        if rule.status == DEFAULT_ONLY and not is_default(value, rule):
            raise BadRequestError(f"{prefix}{name} is not supported: {rule.reason}")


def markdown_list(table: dict[str, Rule], title: str) -> str:
    """One line per status, naming the fields (the reasons are in this module
    and in each 400's message)."""
    labels = {IMPLEMENTED: "implemented", IGNORED: "accepted with any value, no effect",
              DEFAULT_ONLY: "accepted only at null/default, else a 400 naming the field and why"}
    lines = [f"- {title}:"]
    for status, label in labels.items():
        names = ", ".join(f"`{n}`" for n, r in table.items() if r.status == status)
        if names:
            lines.append(f"  - {label}: {names}")
    return "\n".join(lines)


def markdown() -> str:
    return "\n".join([
        markdown_list(GENERATE_FIELDS, "`/generate`, SGLang's `GenerateReqInput` (another name is a 400)"),
        markdown_list(SAMPLING_FIELDS, "`/generate`, SGLang's `SamplingParams` (another name is a 400)"),
        markdown_list(OPENAI_FIELDS, "`/v1/completions`, `/v1/chat/completions` (other names are ignored)"),
    ])


if __name__ == "__main__":
    sys.stdout.write(markdown() + "\n")
