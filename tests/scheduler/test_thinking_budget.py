"""A thinking budget: after `budget` thinking tokens the scheduler forces the
closing tag's tokens (a one-token mask per step, as a grammar's), with and
without the overlap schedule, the real scheduler and a tiny model."""

from __future__ import annotations

import pytest

from common.messages import SamplingParams, ThinkingBudgetSpec, TokenizedGenerateReq
from scheduler_proc.thinking_budget import ThinkingBudget, ThinkingPhase
from tests.scheduler.test_engine_matches_transformers import Engine

MODES = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
PROMPT = [5, 17, 99, 23, 8, 41]
END = [301, 302]  # the closing tag's tokens (any two ids serve a random model)


def _spec_budget(budget: int, start_id: int = -1) -> ThinkingBudget:
    return ThinkingBudget.from_spec(ThinkingBudgetSpec(budget=budget, end_ids=END, start_id=start_id), 512)


def test_the_budget_counts_thinking_tokens_then_forces_the_tag() -> None:
    tb, out = _spec_budget(2), []
    for token in (7, 8):
        assert tb.forced_next is None
        out.append(token)
        tb.accept(out)
    assert [tb.forced_next, tb.phase] == [301, ThinkingPhase.FORCING]
    out.append(301)
    tb.accept(out)
    assert tb.forced_next == 302
    out.append(302)
    tb.accept(out)
    assert tb.phase is ThinkingPhase.DONE and tb.forced_next is None


def test_a_model_that_closes_in_time_is_never_forced() -> None:
    tb, out = _spec_budget(5), [7]
    tb.accept(out)
    out += END
    tb.accept(out[:2])
    tb.accept(out)
    assert tb.phase is ThinkingPhase.DONE


def test_with_an_opening_tag_only_an_output_that_opens_with_it_thinks() -> None:
    tb = _spec_budget(1, start_id=9)
    tb.accept([4])
    assert tb.phase is ThinkingPhase.DONE and not tb.forces_soon(1)
    tb = _spec_budget(0, start_id=9)
    tb.accept([9])
    assert tb.forced_next == 301  # a budget of 0: the tag right after the opening one


def test_a_spent_budget_forces_the_next_step_to_wait_for_the_one_in_flight() -> None:
    tb = _spec_budget(3)
    assert not tb.forces_soon(1) and not tb.forces_soon(2) and tb.forces_soon(3)


def _submit(engine: Engine, rid: str, budget: ThinkingBudgetSpec | None, max_new: int = 12) -> None:
    engine.sched.process_input_requests([TokenizedGenerateReq(
        rid=rid, input_ids=PROMPT, sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0,
                                                                  ignore_eos=True),
        thinking_budget=budget)])


def _outputs(engine: Engine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for msg in engine.outputs:
        for rid, ids in zip(msg.rids, msg.new_token_ids):
            got.setdefault(rid, []).extend(ids)
    return got


def _run(engine: Engine) -> dict[str, list[int]]:
    for _ in range(10_000):
        if engine.sched.step() is None and engine.sched.is_idle():
            engine.assert_no_leak()
            return _outputs(engine)
    raise AssertionError("did not finish")


@MODES
def test_the_tag_follows_exactly_budget_thinking_tokens_and_others_are_untouched(tiny_llama_dir, overlap):
    engine = Engine(tiny_llama_dir, max_running_requests=4, max_total_tokens=512,
                    disable_overlap_schedule=not overlap)
    _submit(engine, "free", None)
    free = _run(engine)["free"]
    _submit(engine, "budget", ThinkingBudgetSpec(budget=4, end_ids=END))
    _submit(engine, "beside", None)  # in the same batch, unconstrained
    _submit(engine, "not-opened", ThinkingBudgetSpec(budget=1, end_ids=END, start_id=free[0] + 1))
    _submit(engine, "opened", ThinkingBudgetSpec(budget=2, end_ids=END, start_id=free[0]))
    got = _run(engine)
    assert got["budget"][:4] == free[:4] and got["budget"][4:6] == END
    assert got["beside"] == free
    assert got["not-opened"] == free  # it never opened a thinking block: nothing forced
    assert got["opened"][:3] == free[:3] and got["opened"][3:5] == END  # the tag, then 2 tokens


def test_a_thinking_budget_with_a_grammar_is_refused(tiny_llama_dir):
    from common.messages import Grammar, GrammarKind
    from tokenizer_proc.finish_json import finish_json

    engine = Engine(tiny_llama_dir, max_running_requests=2, max_total_tokens=256)
    engine.sched.process_input_requests([TokenizedGenerateReq(
        rid="both", input_ids=PROMPT, sampling_params=SamplingParams(
            max_new_tokens=4, grammar=Grammar(GrammarKind.REGEX, "[a-z]+")),
        thinking_budget=ThinkingBudgetSpec(budget=1, end_ids=END))])
    reason = finish_json(engine.outputs[-1].finished_reasons[0])
    assert reason["type"] == "abort" and "grammar" in reason["message"]


class _AllowEven:
    """A grammar matcher stand-in: allows the even token ids."""

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        bitmask[row] = 0x55555555


def test_a_forced_row_and_a_grammar_row_share_one_bitmask() -> None:
    import types

    import numpy as np

    from scheduler_proc.req import Req
    from scheduler_proc.schedule_batch import ScheduleBatch

    def req(rid: str) -> Req:
        return Req(rid=rid, origin_input_ids=PROMPT, sampling_params=SamplingParams(), stop_token_ids=frozenset())

    grammar, forced = req("g"), req("f")
    grammar.grammar = types.SimpleNamespace(matcher=_AllowEven())
    forced.thinking = _spec_budget(0)  # spent at once: forces END[0]
    words = np.frombuffer(ScheduleBatch.init_new([grammar, forced]).constraint_bitmask([0, 1]),
                          dtype=np.int32).reshape(2, -1)
    assert words.shape == (2, 16)  # 512 tokens
    assert (words[0] == 0x55555555).all()
    allowed = [t for t in range(512) if int(words[1, t // 32]) >> (t % 32) & 1]
    assert allowed == [END[0]]


@pytest.mark.parametrize("array", ["numpy", "torch"])  # a forced row alone; beside xgrammar's rows
@pytest.mark.parametrize("token", [0, 30, 31, 32, 511])
def test_allow_only_sets_the_one_bit_of_the_token_sign_bit_included(token: int, array: str) -> None:
    import numpy as np
    import torch

    from scheduler_proc.thinking_budget import allow_only

    bitmask = np.full((1, 16), -1, dtype=np.int32) if array == "numpy" else torch.full((1, 16), -1, dtype=torch.int32)
    allow_only(bitmask, 0, token)
    assert [t for t in range(512) if int(bitmask[0, t // 32]) >> (t % 32) & 1] == [token]
