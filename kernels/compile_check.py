"""Compile every kernel ahead of time for a GPU target, on any machine.

    python -m kernels.compile_check [--arch 90] [--quick] [--with-fp32-extend]

Triton's interpreter runs a kernel's Python body but none of the compiler's
checks (loop-carried types, layouts, shared memory), and computes bfloat16
wrongly; compiling to a cubin with Triton's bundled ptxas needs no GPU and
catches those. Must run without TRITON_INTERPRET (the interpreter replaces
triton.language's own jitted helpers at import), hence a module of its own
that the tests start in a subprocess.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from typing import Any

# before triton is imported (see the docstring)
if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("kernels.compile_check: unset TRITON_INTERPRET first")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import decode_attention as dec  # noqa: E402
from kernels import extend_attention as ext  # noqa: E402
from kernels import kv_cache_ops as kv  # noqa: E402

MAX_SHARED = 100 * 1024  # consumer GPUs (sm_86/89) have ~100 KiB per block; H100 228 KiB


def compile_kernel(kernel: Any, target: GPUTarget, types: dict[str, str], constexprs: dict[str, object],
                   **options: int) -> Any:
    """Every parameter not in `types` or `constexprs` is an i32 scalar."""
    params = list(inspect.signature(kernel.fn).parameters)
    signature = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
    src = ASTSource(kernel, signature, constexprs={(params.index(k),): v for k, v in constexprs.items()})
    start = time.perf_counter()
    compiled = triton.compile(src, target=target, options=options)
    print(f"{kernel.fn.__name__} {constexprs}: "
          f"{compiled.metadata.shared} B shared, {time.perf_counter() - start:.1f} s", flush=True)
    return compiled


def compile_all(arch: int, quick: bool, with_fp32_extend: bool) -> list[str]:
    """Returns the problems found (empty: all compiled and fit). `quick`:
    bfloat16 and float32 only, one decode shape."""
    target = GPUTarget("cuda", arch, 32)
    problems = []
    for dtype in ("bf16", "fp32") if quick else ("bf16", "fp16", "fp32"):
        t, precision = "*" + dtype, "ieee" if dtype == "fp32" else "tf32"
        print(f"-- {dtype}")
        # the Gemma variant (soft-capping) once per dtype
        for (group, head_dim), has_cap in ([((4, 128), False), ((4, 128), True)] if quick else
                                           [((4, 128), False), ((1, 64), False), ((7, 80), False),
                                            ((4, 128), True)]):
            d = max(16, triton.next_power_of_2(head_dim))
            compile_kernel(dec._decode_stage1_kernel, target,
                           dict(Q=t, K_Buffer=t, V_Buffer=t, kv_indptr="*i64", kv_indices="*i64",
                                Mid_O="*fp32", Mid_Lse="*fp32", sm_scale="fp32", logit_cap="fp32"),
                           dict(GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=dec.BLOCK_N,
                                HEAD_DIM=head_dim, HEAD_DIM_V=head_dim, BLOCK_D=d, BLOCK_DV=d,
                                DOT_PRECISION=precision, HAS_CAP=has_cap), num_warps=4, num_stages=2)
        compile_kernel(dec._decode_stage2_kernel, target,
                       dict(Mid_O="*fp32", Mid_Lse="*fp32", O=t, kv_indptr="*i64"),
                       dict(HEAD_DIM_V=128, BLOCK_DV=128), num_warps=4)
        if dtype != "fp32" or with_fp32_extend:  # float32 extend (ieee dot) takes ~15 s
            # the Gemma variant (window and soft-capping) at Gemma's head_dim 256
            for head_dim, gemma in ((64, False), (128, False), (256, False), (256, True)):
                block_m, block_n, warps = ext._block_sizes(head_dim)
                compiled = compile_kernel(
                    ext._extend_attention_kernel, target,
                    dict(Q=t, K_Ext=t, V_Ext=t, O=t, K_Buffer=t, V_Buffer=t, qo_indptr="*i64",
                         kv_indptr="*i64", kv_indices="*i64", sm_scale="fp32", logit_cap="fp32"),
                    dict(GROUP=4, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim,
                         BLOCK_D=head_dim, BLOCK_DV=head_dim, DOT_PRECISION=precision,
                         HAS_WINDOW=gemma, HAS_CAP=gemma),
                    num_warps=warps, num_stages=1)
                if dtype != "fp32" and compiled.metadata.shared > MAX_SHARED:
                    problems.append(f"extend {dtype} head_dim {head_dim}: {compiled.metadata.shared} B shared")
        compile_kernel(kv._store_kv_kernel, target, dict(K=t, V=t, K_Buffer=t, V_Buffer=t, loc="*i64"),
                       dict(HEAD_DIM=128, ROW=1024, BLOCK_T=4, BLOCK_R=1024), num_warps=4)
    compile_kernel(kv._build_kv_indices_kernel, target,
                   dict(req_to_token="*i32", req_pool_indices="*i64", kv_indptr="*i64", kv_indices="*i64"),
                   dict(BLOCK=kv.INDEX_BLOCK), num_warps=4)
    return problems


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 89, 90")
    p.add_argument("--quick", action="store_true", help="fewer dtypes and shapes (the test suite's)")
    p.add_argument("--with-fp32-extend", action="store_true")
    args = p.parse_args()
    problems = compile_all(args.arch, args.quick, args.with_fp32_extend)
    for problem in problems:
        print("PROBLEM:", problem)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
