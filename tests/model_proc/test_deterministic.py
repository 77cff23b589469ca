"""--deterministic: a request's logits and K/V are the same bits whatever
shares its forward (tiny random models on the CPU, float32 unless said)."""

from __future__ import annotations

import random

import pytest
import torch

from common.server_args import ServerArgs
from model_proc.attention import create_attention_backend
from model_proc.attention.batch_invariant import QUERY_CHUNK, BatchInvariantAttnBackend
from model_proc.kv_cache import KVPool, ReqToTokenTable
from model_proc.layers import Linear, onednn_supports
from model_proc.row_blocks import ROW_BLOCK
from tests.helpers import RunnerDriver, greedy_parting, hf_greedy_with_top, load_hf, make_tiny_llama
from tests.model_proc.test_model_matches_transformers import PROMPTS, run_extend_then_decode

PROMPT = [(i * 37) % 500 + 3 for i in range(70)]  # two key tiles
STEPS = 4
SEQ = [(i * 53) % 500 + 3 for i in range(QUERY_CHUNK + 44)]  # past one query chunk, five key tiles


def runner_for(make_runner, folder: str, deterministic: bool, **kwargs):
    kwargs.setdefault("max_running_requests", 24)
    kwargs.setdefault("max_total_tokens", 4096)
    return make_runner(folder, deterministic=deterministic, **kwargs)


def target_logits(runner, prefill_mates: tuple[list[int], ...] = (), decode_mates: tuple[int, ...] = (),
                  position: int = 0, decode_position: int = 0) -> list[torch.Tensor]:
    """The target request's logits at its prefill and at each of STEPS decode
    steps (fixed inputs). `prefill_mates` share its prefill batch (the target
    at `position`) and then decode beside it; `decode_mates` (prompt lengths)
    are prefilled on their own first and join its decode batches, where the
    target sits at `decode_position`."""
    rng = random.Random(0)
    vocab = runner.model_config.vocab_size
    driver = RunnerDriver(runner, seed=1)
    prompts = list(prefill_mates)
    prompts.insert(position, PROMPT)
    rows = [driver.new_row() for _ in prompts]
    out = [runner.compute_logits(driver.extend(rows, prompts))[position]]
    target = rows.pop(position)
    if decode_mates:
        mates = [driver.new_row() for _ in decode_mates]
        runner.compute_logits(driver.extend(mates, [[rng.randrange(3, vocab) for _ in range(n)]
                                                    for n in decode_mates]))
        rows += mates
    rows.insert(decode_position, target)
    for step in range(STEPS):
        tokens = [rng.randrange(3, vocab) for _ in rows]
        tokens[decode_position] = 100 + step
        out.append(runner.compute_logits(driver.decode(rows, tokens))[decode_position])
    return out


# a batch of 1 (alone), 2, 3, 7 and 20 (two row blocks) rows, the target first,
# in the middle or last, beside shorter and longer rows; and prompts beside it in its prefill
COMPANIES = {
    "decode_2": dict(decode_mates=(5,)),
    "decode_3_last": dict(decode_mates=(130, 9), decode_position=2),
    "decode_7_middle": dict(decode_mates=(3, 200, 64, 65, 1, 40), decode_position=3),
    "decode_20_middle": dict(decode_mates=tuple(range(7, 140, 7)), decode_position=17),
    "prefill_3_middle": dict(prefill_mates=([7] * 50, [9, 8, 7]), position=1, decode_position=1),
    "prefill_2_first": dict(prefill_mates=([11] * 150,), position=0, decode_position=1),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_are_bit_identical_whatever_shares_the_batch(dtype, tiny_llama_dir, make_runner):
    if dtype == "bfloat16" and not onednn_supports(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no native bfloat16 matmul here: not checked")
    runner = runner_for(make_runner, tiny_llama_dir, deterministic=True, dtype=dtype)
    alone = target_logits(runner)
    for name, company in COMPANIES.items():
        got = target_logits(runner, **company)
        for step, (a, b) in enumerate(zip(alone, got)):
            assert torch.equal(a, b), f"{name}: step {step} differs by {(a - b).abs().max().item():.3g}"


def test_without_the_flag_the_bits_depend_on_the_batch(tiny_llama_dir, make_runner):
    """The control: what --deterministic is for (the torch backend pads a
    decode batch to its longest row; small matmuls take other kernels)."""
    # the torch backend: the one --deterministic replaces (native's decode kernel
    # happens to be batch-invariant at these shapes)
    runner = runner_for(make_runner, tiny_llama_dir, deterministic=False, attention_backend="torch")
    alone = target_logits(runner)
    differs = [name for name, company in COMPANIES.items()
               if not all(torch.equal(a, b) for a, b in zip(alone, target_logits(runner, **company)))]
    assert differs, "the default forward was batch-invariant here: the flag would buy nothing"


def test_decode_in_row_chunks_gives_the_same_bits(tiny_llama_dir, make_runner, monkeypatch):
    runner = runner_for(make_runner, tiny_llama_dir, deterministic=True)
    whole = target_logits(runner, **COMPANIES["decode_7_middle"])
    monkeypatch.setattr(BatchInvariantAttnBackend, "decode_chunk_bytes", 1)  # one row per chunk
    chunked = target_logits(runner, **COMPANIES["decode_7_middle"])
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


@pytest.mark.parametrize("heads,kv_heads", [(7, 1), (4, 4)], ids=["mqa_7_per_kv_head", "mha"])
def test_other_head_groupings_are_invariant_too(heads, kv_heads, tmp_path, make_runner):
    """7 query heads on one KV head: the grouping whose batched matmul takes
    another kernel for a batch of one matrix."""
    folder = make_tiny_llama(str(tmp_path), seed=4, hidden_size=64 * heads, num_attention_heads=heads,
                             num_key_value_heads=kv_heads)
    runner = runner_for(make_runner, folder, deterministic=True)
    alone = target_logits(runner)
    for name in ("decode_2", "decode_7_middle", "prefill_3_middle"):
        assert all(torch.equal(a, b) for a, b in zip(alone, target_logits(runner, **COMPANIES[name]))), name
    # one key tile and one-token extends: matmul batches of a single matrix
    assert_same_bits_however_fed(runner, SEQ[:40], {"extends": [("extend", 20), ("extend", 1), ("extend", 19)]})


def feed(runner, seq: list[int], pieces: list[tuple[str, int]]) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
    """seq fed to one row in pieces, ("extend", n) or ("decode", n steps):
    the logits after each position fed last, and every layer's K and V of seq."""
    driver = RunnerDriver(runner, seed=2)
    row, pos, logits = driver.new_row(), 0, {}
    for kind, n in pieces:
        if kind == "extend":
            logits[pos + n - 1] = runner.compute_logits(driver.extend([row], [seq[pos:pos + n]]))[0]
            pos += n
        else:
            for _ in range(n):
                logits[pos] = runner.compute_logits(driver.decode([row], [seq[pos]]))[0]
                pos += 1
    assert pos == len(seq)
    slots = runner.req_to_token.table[row, :pos].long()
    return logits, [buf[slots].clone() for buf in runner.kv_pool.k_buffer + runner.kv_pool.v_buffer]


def assert_same_bits_however_fed(runner, seq: list[int], variants: dict[str, list[tuple[str, int]]]) -> None:
    by_decode, kv = feed(runner, seq, [("extend", 1), ("decode", len(seq) - 1)])
    for name, pieces in variants.items():
        logits, kv_other = feed(runner, seq, pieces)
        for pos, row in logits.items():
            assert torch.equal(row, by_decode[pos]), f"{name}: logits after position {pos} differ"
        assert all(torch.equal(a, b) for a, b in zip(kv, kv_other)), f"{name}: K/V differ"


def test_prefill_chunked_prefill_and_decode_give_the_same_bits(tiny_llama_dir, make_runner):
    """A token's bits do not depend on how it was computed: one extend, chunks
    of any size (one token included), or decode steps. So a request
    recomputed after a retraction gets its K/V back bit for bit."""
    runner = runner_for(make_runner, tiny_llama_dir, deterministic=True)
    assert_same_bits_however_fed(runner, SEQ, {
        "one extend": [("extend", len(SEQ))],
        "chunks": [("extend", 37), ("extend", 1), ("extend", 200), ("decode", 2), ("extend", len(SEQ) - 240)],
    })


def test_row_blocked_linear_ignores_block_mates_and_position():
    """The premise of the row blocks, on the shape that is not invariant
    plainly on this CPU (the default model's down projection, K = 1536)."""
    gen = torch.Generator().manual_seed(5)
    lin = Linear(1536, 96, bias=True)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05, generator=gen)
        lin.bias.normal_(0, 1, generator=gen)
    lin.prepare()
    lin.batch_invariant = True
    x, other = torch.randn(2 * ROW_BLOCK + 3, 1536, generator=gen), torch.randn(2 * ROW_BLOCK + 3, 96, generator=gen)
    with torch.inference_mode():
        alone = [lin(x[i:i + 1], add=other[i:i + 1]) for i in range(x.shape[0])]
        for rows in (2, 3, 7, ROW_BLOCK, ROW_BLOCK + 1, x.shape[0]):
            for start in (0, x.shape[0] - rows):
                out = lin(x[start:start + rows], add=other[start:start + rows])
                assert all(torch.equal(out[i], alone[start + i][0]) for i in range(rows)), (rows, start)


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_deterministic_logits_equal_transformers(model, request, make_runner):
    folder = request.getfixturevalue(f"tiny_{model}_dir")
    run_extend_then_decode(runner_for(make_runner, folder, deterministic=True), load_hf(folder), PROMPTS)


def test_deterministic_greedy_equals_transformers_generate(tiny_llama_dir, tiny_llama_hf, make_runner):
    """Prompts decoded together; each row against its own generate, by the
    near-tie criterion."""
    runner = runner_for(make_runner, tiny_llama_dir, deterministic=True)
    driver = RunnerDriver(runner)
    rows = [driver.new_row() for _ in PROMPTS]
    logits = runner.compute_logits(driver.extend(rows, PROMPTS))
    ours: list[list[int]] = [[] for _ in PROMPTS]
    tops: list[list[list[int]]] = [[] for _ in PROMPTS]
    for _ in range(12):
        for i, row_logits in enumerate(logits):
            ours[i].append(int(row_logits.argmax()))
            tops[i].append(row_logits.topk(5).indices.tolist())
        logits = runner.compute_logits(driver.decode(rows, [o[-1] for o in ours]))
    for prompt, out, top in zip(PROMPTS, ours, tops):
        ref, ref_top = hf_greedy_with_top(tiny_llama_hf, prompt, 12)
        greedy_parting(out, top, ref, ref_top)


def test_deterministic_flag_and_its_backend_check(tiny_llama_dir):
    assert ServerArgs.from_cli(["--model-path", tiny_llama_dir, "--deterministic"]).deterministic
    assert not ServerArgs(model_path=tiny_llama_dir).deterministic
    pool, table = KVPool(8, 1, 1, 4, torch.float32, "cpu"), ReqToTokenTable(2, 8, "cpu")
    assert isinstance(create_attention_backend("torch", pool, table, 0.5, deterministic=True),
                      BatchInvariantAttnBackend)
    with pytest.raises(ValueError, match="--deterministic needs --attention-backend torch"):
        create_attention_backend("triton", pool, table, 0.5, deterministic=True)
