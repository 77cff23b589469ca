"""StepInputs: a step's lists become tensors once, in buffers reused from step to step."""

from __future__ import annotations

import torch

from common.messages import FUTURE_TOKEN, ForwardBatch, ForwardMode
from model_proc.step_inputs import StepInputBuilder


def batch(mode: ForwardMode, rows: list[int], seq_lens: list[int], prefix_lens: list[int], input_ids: list[int],
          decode_rows: int = 0, **kw: object) -> ForwardBatch:
    b = len(rows)
    return ForwardBatch(mode, rows, seq_lens, prefix_lens, input_ids, [100 + i for i in range(len(input_ids))],
                        [0.5] * b, [0.9] * b, [7] * b, [0.1] * b, [-1] * b, [0] * b, decode_rows=decode_rows, **kw)


def builder(rows: int = 8, tokens: int = 16) -> StepInputBuilder:
    table = torch.arange(9 * 32, dtype=torch.int32).view(9, 32)
    last_sampled = torch.arange(9, dtype=torch.int64) * 1000
    return StepInputBuilder(table, last_sampled, rows=rows, tokens=tokens)


def test_a_mixed_step_has_its_rows_positions_and_indptrs_and_resolves_only_its_decoding_rows():
    b = builder()
    fb = batch(ForwardMode.MIXED, [3, 5, 2], [6, 4, 9], [2, 3, 8], [11, 12, 13, 14, FUTURE_TOKEN, FUTURE_TOKEN],
               decode_rows=2, penalty_rows=[2], table_rows=[3, 5], table_lens=[2, 1], table_slots=[7, 8, 9])
    x = b.build(fb)
    assert (x.mode, x.batch_size, x.num_tokens, x.decode_rows) == (ForwardMode.MIXED, 3, 6, 2)
    assert x.input_ids.tolist() == [11, 12, 13, 14, 5000, 2000]
    assert x.positions.tolist() == [2, 3, 4, 5, 3, 8]
    assert x.token_rows.tolist() == [3, 3, 3, 3, 5, 2]
    assert x.qo_indptr.tolist() == [0, 4, 5, 6]
    assert x.kv_indptr.tolist() == [0, 6, 10, 19]
    assert x.out_cache_loc.tolist() == list(range(100, 106))
    assert x.penalty_rows.tolist() == [2]
    assert x.table_rewrite is not None and [t.tolist() for t in x.table_rewrite] == [[3, 5], [2, 1], [7, 8, 9]]
    table = b.table
    assert x.kv_indices.tolist() == table[3, :6].tolist() + table[5, :4].tolist() + table[2, :9].tolist()
    assert x.sampling is not None and x.sampling.top_ks.tolist() == [7] * 3
    assert torch.equal(x.sampling.temperatures, torch.full((3,), 0.5))

    extend, decode = x.split(1)
    assert extend is not None and extend.mode is ForwardMode.EXTEND and decode.mode is ForwardMode.DECODE
    assert extend.qo_indptr.tolist() == [0, 4] and extend.kv_indices.tolist() == table[3, :6].tolist()
    assert decode.qo_indptr.tolist() == [0, 1, 2] and decode.kv_indptr.tolist() == [0, 4, 13]
    assert decode.kv_indices.tolist() == table[5, :4].tolist() + table[2, :9].tolist()
    assert decode.input_ids.tolist() == [5000, 2000] and decode.out_cache_loc.tolist() == [104, 105]


def test_a_decode_step_reuses_the_buffers_and_a_bigger_step_grows_them():
    b = builder(rows=2, tokens=2)
    first = b.build(batch(ForwardMode.DECODE, [1, 4], [5, 7], [], [FUTURE_TOKEN, 9]))
    assert first.table_rewrite is None and first.penalty_rows is None and first.input_logprob_index is None
    assert first.input_ids.tolist() == [1000, 9]
    assert first.positions.tolist() == first.prefix_lens.tolist() == [4, 6]
    assert first.qo_indptr.tolist() == [0, 1, 2] and first.kv_indptr.tolist() == [0, 5, 12]
    address = first.req_pool_indices.data_ptr()
    second = b.build(batch(ForwardMode.DECODE, [2, 3], [3, 3], [], [8, 9]))
    assert second.req_pool_indices.data_ptr() == address  # the same buffer, rewritten
    big = b.build(batch(ForwardMode.EXTEND, [1, 2, 3, 4, 5], [9] * 5, [0] * 5, list(range(45))))
    assert big.input_ids.tolist() == list(range(45)) and big.qo_indptr.tolist() == [0, 9, 18, 27, 36, 45]
    assert big.positions.tolist() == list(range(9)) * 5
