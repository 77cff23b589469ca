"""max_new_tokens 0 (SGLang's prefill-only request, which its frontend's
`select` and prefix caching send): the prompt is prefilled, cached and
scored, and the request ends by length with no output token; no decode step
ever carries its row, and nothing else in the batch changes."""

from __future__ import annotations

import pytest

from common.messages import ForwardMode, SamplingParams, TokenizedGenerateReq
from tests.scheduler.test_input_logprobs import _check, _input_logprobs, _prompt, _run
from tests.scheduler.test_engine_matches_transformers import Engine
from tests.scheduler.test_scheduler import Harness

MODES = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])


@MODES
@pytest.mark.parametrize("chunk,mixed", [(-1, False), (16, False), (16, True)],
                         ids=["whole", "chunk16", "chunk16-mixed"])
def test_zero_token_requests_end_after_their_prefill_with_no_token(overlap, chunk, mixed):
    h = Harness(max_running=4, chunked_prefill_size=chunk, enable_mixed_chunk=mixed,
                disable_overlap_schedule=not overlap)
    h.submit("long", 20, 30, ignore_eos=True)  # running while the others arrive
    h.sched.step()
    h.sched.step()
    for k in range(3):
        h.submit(f"zero{k}", 40 + k, 0, stream=k == 1)
    h.submit("short", 12, 5, ignore_eos=True)
    h.run_until_idle()
    finals = h.finals()
    for k in range(3):
        assert finals[f"zero{k}"] == ({"type": "length", "length": 0}, 0)
        assert h.tokens(f"zero{k}") == []
    assert finals["long"] == ({"type": "length", "length": 30}, 30)
    assert finals["short"] == ({"type": "length", "length": 5}, 5)
    # no decode row was ever built for a zero-token request: every decode
    # step's rows are the two generating requests at most
    decode_rows = [len(b.req_pool_indices) if b.forward_mode is ForwardMode.DECODE else b.decode_rows
                   for b in h.model.batches]
    assert max(decode_rows) <= 2
    h.assert_no_leak()


@MODES
def test_a_zero_token_request_warms_the_prefix_cache(overlap):
    h = Harness(max_running=4, disable_overlap_schedule=not overlap)
    h.submit("warm", 50, 0)
    h.run_until_idle()
    h.submit("warm", 50, 4, ignore_eos=True)  # the same rid and prompt, generating this time
    h.run_until_idle()
    cached = [m.cached_tokens[i] for m in h.outputs for i, r in enumerate(m.rids)
              if r == "warm" and m.finished_reasons[i] is not None]
    assert cached == [0, 49]  # all but the last prompt token, computed for its logits
    h.assert_no_leak()


@MODES
def test_a_zero_token_request_returns_its_prompt_logprobs(tiny_llama_dir, overlap):
    engine = Engine(tiny_llama_dir, max_running_requests=4, max_total_tokens=512, chunked_prefill_size=16,
                    disable_overlap_schedule=not overlap)
    prompt = _prompt(30, 45)
    for rid, start in (("scored", 0), ("tail", 40)):
        engine.sched.process_input_requests([TokenizedGenerateReq(
            rid=rid, input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=0, temperature=0.0),
            return_logprob=True, top_logprobs_num=2, logprob_start_len=start)])
    _run(engine)
    engine.assert_no_leak()
    for rid, start in (("scored", 0), ("tail", 40)):
        lps, tops = _input_logprobs(engine.outputs, rid)
        _check(tiny_llama_dir, prompt, start, lps, tops, 2)
        finals = [(m.new_token_ids[i], m.output_token_logprobs[i]) for m in engine.outputs
                  for i, r in enumerate(m.rids) if r == rid and m.finished_reasons[i] is not None]
        assert finals == [([], [])]


@MODES
@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_a_zero_token_row_is_kept_as_padding_in_the_padded_baselines(overlap, batching):
    """Static batching keeps a finished row computing until its batch ends: a
    prefill-only row has no output token to feed, so it decodes the model's
    (dropped) last sampled token."""
    h = Harness(max_running=3, batching=batching, disable_overlap_schedule=not overlap)
    h.submit("a", 20, 6, ignore_eos=True)
    h.submit("zero", 30, 0)
    h.submit("b", 10, 3, ignore_eos=True)
    h.run_until_idle()
    assert h.finals() == {"zero": ({"type": "length", "length": 0}, 0),
                          "a": ({"type": "length", "length": 6}, 6), "b": ({"type": "length", "length": 3}, 3)}
    h.assert_no_leak()
