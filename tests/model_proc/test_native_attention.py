"""The native C++ attention op (model_proc/native/) against the torch
backend, through the backend interface, and the tiny model end to end."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from common.messages import ForwardBatch, ForwardMode
from model_proc import native
from model_proc.attention import create_attention_backend
from model_proc.attention.native import MixedAttnMetadata, NativeAttnBackend
from model_proc.attention.torch_backend import TorchAttnBackend
from model_proc.kv_cache import KVPool, ReqToTokenTable
from tests.helpers import RunnerDriver, step_inputs

REPO = Path(__file__).resolve().parents[2]

KV_HEADS, POOL = 2, 2600
LENS = [1, 7, 96, 300, 2048]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative (norm) error against float32 torch

needs_op = pytest.mark.skipif(native.load() is None, reason=f"native op not built: {native.failure()}")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def make_pair(dtype: torch.dtype, group: int, head_dim: int, seed: int
              ) -> tuple[NativeAttnBackend, TorchAttnBackend, torch.Generator]:
    """A native backend over a random pool of `dtype`, and the torch backend
    over the same values in float32 (its reference)."""
    gen = torch.Generator().manual_seed(seed)
    pools = [KVPool(POOL, num_layers=1, num_kv_heads=KV_HEADS, head_dim=head_dim, dtype=d, device="cpu")
             for d in (dtype, torch.float32)]
    for ours, ref in zip(pools[0].k_buffer + pools[0].v_buffer, pools[1].k_buffer + pools[1].v_buffer):
        ours[1:] = torch.randn(ours[1:].shape, generator=gen).to(dtype)  # stale data everywhere
        ref.copy_(ours.float())
    table = ReqToTokenTable(num_rows=len(LENS) + 1, context_len=2100, device="cpu")
    scale = head_dim ** -0.5
    ours = NativeAttnBackend(pools[0], table, scale)
    ours.native_extend = True  # the op's extend too (the backend's default leaves extend to torch)
    return ours, TorchAttnBackend(pools[1], table, scale), gen


def fill_rows(table: torch.Tensor, rows: list[int], lens: list[int], gen: torch.Generator) -> None:
    """Scattered slots in no order, as a pool looks after retractions and evictions."""
    slots = (torch.randperm(POOL, generator=gen) + 1).to(torch.int32)
    used = 0
    for row, n in zip(rows, lens):
        table[row, :n] = slots[used:used + n]
        used += n


def make_batch(mode: str, rows: list[int], seq_lens: list[int], prefix_lens: list[int],
               num_new: int, decode_rows: int = 0) -> ForwardBatch:
    b = len(rows)
    return ForwardBatch(ForwardMode(mode), rows, seq_lens, prefix_lens, [0] * num_new, [0] * num_new,
                        [0.0] * b, [1.0] * b, [-1] * b, [0.0] * b, [-1] * b, [0] * b, decode_rows=decode_rows)


def run_both(ours: NativeAttnBackend, ref: TorchAttnBackend, batch: ForwardBatch, loc: torch.Tensor,
             q_heads: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = ours.kv_pool.k_buffer[0].shape[2]
    t = len(batch.input_ids)
    q = torch.randn(t, q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(t, KV_HEADS, head_dim, generator=gen).to(dtype)
    v = torch.randn(t, KV_HEADS, head_dim, generator=gen).to(dtype)
    inputs = step_inputs(batch, ours.req_to_token.table, loc)  # the two backends share the table
    out = ours.forward(q, k, v, 0, ours.init_forward_metadata(inputs))
    expected = ref.forward(q.float(), k.float(), v.float(), 0, ref.init_forward_metadata(inputs))
    assert torch.equal(ours.kv_pool.k_buffer[0][loc], k)  # stored before use
    assert out.dtype == dtype and out.shape == q.shape
    return out, expected


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_over_ragged_rows_equals_torch(dtype: torch.dtype, group: int, head_dim: int) -> None:
    ours, ref, gen = make_pair(dtype, group, head_dim, seed=group * 1000 + head_dim)
    rows = [4, 1, 5, 3, 2]
    lens = [LENS[i] for i in (2, 0, 4, 1, 3)]
    table = ours.req_to_token.table
    fill_rows(table, rows, lens, gen)
    loc = torch.tensor([table[r, n - 1].item() for r, n in zip(rows, lens)])
    out, expected = run_both(ours, ref, make_batch("decode", rows, lens, [], len(rows)), loc,
                             group * KV_HEADS, dtype, gen)
    for i in range(len(rows)):
        assert rel_err(out[i], expected[i]) < TOL[dtype], f"row {i} ({lens[i]} tokens)"


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_over_an_int8_pool_equals_the_torch_paths_dequantized_read(dtype: torch.dtype, group: int,
                                                                         head_dim: int) -> None:
    """--kv-cache-dtype int8: the op reads the int8 rows and their scales in
    place; the torch backend over the same pool dequantizes what it gathers."""
    gen = torch.Generator().manual_seed(7 * group + head_dim)
    pools = [KVPool(POOL, num_layers=1, num_kv_heads=KV_HEADS, head_dim=head_dim, dtype=d, device="cpu", int8=True)
             for d in (dtype, torch.float32)]
    for name in ("k_buffer", "v_buffer", "k_scale", "v_scale"):
        ours, ref = getattr(pools[0], name)[0], getattr(pools[1], name)[0]
        if ours.dtype == torch.int8:
            ours[1:] = torch.randint(-127, 128, ours[1:].shape, generator=gen, dtype=torch.int8)
        else:
            ours[1:] = torch.rand(ours[1:].shape, generator=gen) * 0.02
        ref.copy_(ours)
    table = ReqToTokenTable(num_rows=len(LENS) + 1, context_len=2100, device="cpu")
    ours, ref = NativeAttnBackend(pools[0], table, head_dim ** -0.5), TorchAttnBackend(pools[1], table,
                                                                                       head_dim ** -0.5)
    rows, lens = [4, 1, 5, 3, 2], [LENS[i] for i in (2, 0, 4, 1, 3)]
    fill_rows(table.table, rows, lens, gen)
    loc = torch.tensor([table.table[r, n - 1].item() for r, n in zip(rows, lens)])
    inputs = step_inputs(make_batch("decode", rows, lens, [], len(rows)), table.table, loc)
    q = torch.randn(len(rows), group * KV_HEADS, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(len(rows), KV_HEADS, head_dim, generator=gen).to(dtype) for _ in range(2))
    out = ours.forward(q, k, v, 0, ours.init_forward_metadata(inputs))
    expected = ref.forward(q.float(), k.float(), v.float(), 0, ref.init_forward_metadata(inputs))
    assert torch.equal(pools[0].k_buffer[0][loc], pools[1].k_buffer[0][loc])  # stored with the same bits
    for i in range(len(rows)):
        assert rel_err(out[i], expected[i]) < TOL[dtype], f"row {i} ({lens[i]} tokens)"


@needs_op
def test_a_lone_short_row_is_split_between_threads() -> None:
    """One row of a few hundred keys (a single user) is split so that every
    thread gets some of it; no split under 64 keys; many rows need none."""
    op, threads = native.load(), torch.get_num_threads()
    if threads < 2:
        pytest.skip("one thread: nothing to share")
    assert op.choose_splits(1, 128) >= 2 and op.choose_splits(1, 256) >= 2
    assert op.choose_splits(1, 127) == 1
    assert 256 // op.choose_splits(1, 256) >= 64
    assert op.choose_splits(4 * threads, 256) == 1


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[2048], [1, 2048], [300, 7]])
def test_decode_with_kv_splits_equals_torch(dtype: torch.dtype, lens: list[int]) -> None:
    """Few rows: each row's keys go in splits (some empty: a 1-token row) merged after."""
    assert native.load().choose_splits(len(lens), max(lens)) > 1 or max(lens) < 1024
    ours, ref, gen = make_pair(dtype, 3, 64, seed=len(lens))
    rows = list(range(1, len(lens) + 1))
    table = ours.req_to_token.table
    fill_rows(table, rows, lens, gen)
    loc = torch.tensor([table[r, n - 1].item() for r, n in zip(rows, lens)])
    out, expected = run_both(ours, ref, make_batch("decode", rows, lens, [], len(rows)), loc,
                             3 * KV_HEADS, dtype, gen)
    assert rel_err(out, expected) < TOL[dtype]


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_extend_over_prefix_and_causal_tail_equals_torch(dtype: torch.dtype, group: int, head_dim: int) -> None:
    ours, ref, gen = make_pair(dtype, group, head_dim, seed=7 * group + head_dim)
    # (prefix, new): no prefix; one new token; tiles of 32 with a ragged last one;
    # new tokens after a long prefix
    rows = [3, 1, 5, 2, 4]
    prefix_lens = [0, 7, 0, 260, 1990]
    seq_lens = [7, 8, 96, 300, 2048]
    table = ours.req_to_token.table
    fill_rows(table, rows, seq_lens, gen)
    loc = torch.cat([table[r, p:s].long() for r, s, p in zip(rows, seq_lens, prefix_lens)])
    batch = make_batch("extend", rows, seq_lens, prefix_lens, loc.numel())
    out, expected = run_both(ours, ref, batch, loc, group * KV_HEADS, dtype, gen)
    q0 = 0
    for s, p in zip(seq_lens, prefix_lens):
        assert rel_err(out[q0:q0 + s - p], expected[q0:q0 + s - p]) < TOL[dtype], f"prefix {p}, {s - p} new"
        q0 += s - p


def test_backend_without_the_op_is_the_torch_path(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """No compiler or a failed build: one warning, then the torch path."""
    monkeypatch.setattr(native, "_modules", {})
    monkeypatch.setattr(native, "_failures", {})
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    pool = KVPool(64, num_layers=1, num_kv_heads=KV_HEADS, head_dim=64, dtype=torch.float32, device="cpu")
    table = ReqToTokenTable(num_rows=2, context_len=64, device="cpu")
    with caplog.at_level(logging.WARNING):
        backend = create_attention_backend("native", pool, table, 0.125)
        create_attention_backend("native", pool, table, 0.125)
    assert backend.op is None
    lines = [r.getMessage() for r in caplog.records if "native attention op" in r.getMessage()]
    assert len(lines) == 1 and "no C++ compiler" in lines[0] and "torch" in lines[0]
    assert isinstance(backend.torch, TorchAttnBackend)  # every step goes to the torch backend it holds


@needs_op
def test_head_dim_without_a_kernel_uses_the_torch_path() -> None:
    pool = KVPool(64, num_layers=1, num_kv_heads=KV_HEADS, head_dim=48, dtype=torch.float32, device="cpu")
    table = ReqToTokenTable(num_rows=2, context_len=64, device="cpu")
    assert create_attention_backend("native", pool, table, 0.125).op is None


PROMPTS = [[1, 45, 300, 12, 7, 99, 101], [9, 8], list(range(20, 60))]


def greedy_run(runner: Any, steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Ragged prefill, decode, an extend after a prefix in the pool (a
    follow-up turn), decode again; every step's logits."""
    driver = RunnerDriver(runner)
    rows = [driver.new_row() for _ in PROMPTS]
    logits = []

    def step(batch: ForwardBatch) -> list[int]:
        logits.append(runner.compute_logits(batch))
        return logits[-1].argmax(-1).tolist()

    out = [[t] for t in step(driver.extend(rows, PROMPTS))]
    for phase in range(2):
        for _ in range(steps):
            for o, t in zip(out, step(driver.decode(rows, [o[-1] for o in out]))):
                o.append(t)
        if phase == 0:
            for o, t in zip(out, step(driver.extend(rows, [[o[-1], 17, 33] for o in out]))):
                o.append(t)
    return out, logits


@needs_op
@pytest.mark.parametrize("native_extend", [False, True])
def test_model_greedy_output_with_native_backend_equals_torch_backend(tiny_llama_dir: str, make_runner: Any,
                                                                      native_extend: bool) -> None:
    tokens, logits = {}, {}
    for name in ("torch", "native"):
        runner = make_runner(tiny_llama_dir, attention_backend=name)
        assert type(runner.attn_backend).__name__.lower().startswith(name)
        runner.attn_backend.native_extend = native_extend
        tokens[name], logits[name] = greedy_run(runner, steps=6)
    assert runner.attn_backend.op is not None
    assert tokens["native"] == tokens["torch"]
    for ours, ref in zip(logits["native"], logits["torch"]):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extend_rows", [2, 0])
@pytest.mark.parametrize("native_extend", [False, True], ids=["torch-extend", "op-extend"])
def test_mixed_step_decodes_its_one_token_rows_with_the_op(dtype: torch.dtype, extend_rows: int,
                                                           native_extend: bool) -> None:
    """A mixed step (--enable-mixed-chunk): extend rows, then running rows of
    one new token each; those take the decode kernel whichever path the
    extend rows take, and the whole equals torch's extend."""
    ours, ref, gen = make_pair(dtype, 3, 64, seed=40 + extend_rows)
    ours.native_extend = native_extend
    rows = [3, 1, 5, 2, 4][-(extend_rows + 3):]
    prefix_lens = [0, 260, 6, 199, 1499][-(extend_rows + 3):]
    seq_lens = [96, 300, 7, 200, 1500][-(extend_rows + 3):]
    table = ours.req_to_token.table
    fill_rows(table, rows, seq_lens, gen)
    loc = torch.cat([table[r, p:s].long() for r, s, p in zip(rows, seq_lens, prefix_lens)])
    batch = make_batch("mixed", rows, seq_lens, prefix_lens, loc.numel(), decode_rows=3)
    meta = ours.init_forward_metadata(step_inputs(batch, table, loc))
    assert isinstance(meta, MixedAttnMetadata) and meta.decode.batch_size == 3
    assert (meta.extend is None) == (extend_rows == 0)
    assert torch.equal(meta.qo_indptr, torch.tensor([0, *torch.tensor(seq_lens).sub(torch.tensor(prefix_lens))
                                                     .cumsum(0).tolist()]))
    out, expected = run_both(ours, ref, batch, loc, 3 * KV_HEADS, dtype, gen)
    q0 = 0
    for s, p in zip(seq_lens, prefix_lens):
        assert rel_err(out[q0:q0 + s - p], expected[q0:q0 + s - p]) < TOL[dtype], f"prefix {p}, {s - p} new"
        q0 += s - p


@needs_op
def test_a_build_killed_midway_does_not_hang_the_next_load() -> None:
    """A build killed while it held torch's lock file (a server stopped during
    its first start) left the file behind, and every later start waited for
    it forever. The op is already built here: the load must just return it."""
    lock = Path(native.build_dir("attention")) / "lock"
    lock.touch()
    code = "from model_proc import native; assert native.load() is not None, native.failure()"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not lock.exists()


def test_a_module_s_build_directory_follows_its_headers_and_holds_their_copies(tmp_path, monkeypatch) -> None:
    """The build directory's name hashes a module's source and the headers it
    includes (MODULE_HEADERS): a changed header is a new build, not the old
    binary; and the headers are copied beside the source, where its
    `#include "..."` finds them."""
    src = tmp_path / "src"
    src.mkdir()
    for file in ("quant.cpp", *native.MODULE_HEADERS["quant"]):
        (src / file).write_bytes((Path(native.HERE) / file).read_bytes())
    monkeypatch.setattr(native, "HERE", str(src))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    before = native.build_dir("quant")
    header = src / native.MODULE_HEADERS["quant"][0]
    header.write_text(header.read_text() + "\n// changed\n")
    after = native.build_dir("quant")
    assert after != before
    copy = native._source_copy("quant", after)
    assert Path(copy).name == "quant.cpp" and (Path(after) / header.name).read_text() == header.read_text()
