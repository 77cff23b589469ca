"""Write a Llama checkpoint as a GGUF in a chosen block type, with the default
model's tokenizer (bench/lib/gguf_models.py): a bench model (`--bench-model
llama1b`, built first if missing, the file written beside its folder) or any
Llama folder with the default vocabulary. Prints the file's path.

    python scripts/bench_gguf.py --bench-model llama1b --qtype Q4_0
    python scripts/bench_gguf.py --model-dir DIR --qtype Q8_0 --out FILE
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.lib import bench_models  # noqa: E402 (the repository on the path first)
from bench.lib.gguf_models import QTYPES, ensure_bench_gguf, write_llama_gguf  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="a Llama Hugging Face folder with the default vocabulary")
    p.add_argument("--bench-model", choices=list(bench_models.FAMILIES),
                   help="instead of --model-dir: a bench_models family, written beside its folder")
    p.add_argument("--qtype", required=True, choices=QTYPES)
    p.add_argument("--out", help="with --model-dir: the file to write")
    a = p.parse_args()
    if a.bench_model:
        print(ensure_bench_gguf(a.bench_model, a.qtype))
    elif a.model_dir and a.out:
        print(write_llama_gguf(a.model_dir, a.out, a.qtype))
    else:
        p.error("give --bench-model, or --model-dir and --out")


if __name__ == "__main__":
    main()
