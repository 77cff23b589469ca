"""Each architecture through GGUF (issue 30 item 5), a check to run by hand:
a tiny random model of each family (the default model's tokenizer), written
as GGUF (f32) by llama.cpp's own convert_hf_to_gguf.py, then loaded from the
.gguf by our loader (transformers' GGUF reader into a HF folder, as
`--model-path x.gguf` does): last-position logits against transformers on
the original folder. Needs llama.cpp's sources (the llama-cpp-python sdist:
`pip download llama-cpp-python --no-binary :all: --no-deps -d /work/peers/src`,
extracted), hence not a test.

    python scripts/gguf_families_check.py [family ...]

Families whose hyperparameters a GGUF cannot carry are listed twice, as the
converter leaves them (mistral's sliding window: the GGUF says llama; Gemma
3's query_pre_attn_scalar: transformers reads 256) and at values it keeps.
Phi-3 and Gemma 2 need their own sentencepiece tokenizer.model to convert."""
import glob
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.server_args import ServerArgs  # noqa: E402 (the repository on the path first)
from model_proc.runner import ModelRunner  # noqa: E402
from tests.helpers import RunnerDriver, hf_last_logits, load_hf, make_tiny_llama  # noqa: E402

LLAMA_CPP = os.environ.get("LLAMA_CPP") or glob.glob("/work/peers/src/llama_cpp_python-*/vendor/llama.cpp")[0]
TOK = glob.glob(os.path.expanduser("~/.cache/batchserve/SmolLM2-135M-Instruct*"))[0]
FAMILIES = {
    "llama": {},
    "qwen3": {"model_type": "qwen3"},
    "qwen3_hd128": {"model_type": "qwen3", "head_dim": 128},
    "mistral_nowindow": {"model_type": "mistral"},
    "phi3": {"model_type": "phi3"},
    "mistral": {"model_type": "mistral", "sliding_window": 8},
    "gemma2": {"model_type": "gemma2", "sliding_window": 8, "query_pre_attn_scalar": 24, "attn_implementation": "eager"},
    "gemma3": {"model_type": "gemma3_text", "sliding_window": 8, "query_pre_attn_scalar": 24,
               "layer_types": ["sliding_attention", "full_attention"]},
    "gemma3_pattern6": {"model_type": "gemma3_text", "sliding_window": 8, "query_pre_attn_scalar": 256, "num_hidden_layers": 6,
               "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
}
prompt = [5, 900, 33, 1200, 7, 45, 300, 12, 8, 19, 401, 77, 2000, 3, 15, 16, 17, 18]
root = tempfile.mkdtemp()
for fam, over in FAMILIES.items():
    if len(sys.argv) > 1 and fam not in sys.argv[1:]:
        continue
    d = os.path.join(root, fam)
    make_tiny_llama(d, seed=3, vocab_size=49152, **over)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(TOK, f)):
            shutil.copy(os.path.join(TOK, f), d)
    out = os.path.join(root, f"{fam}.gguf")
    r = subprocess.run([sys.executable, f"{LLAMA_CPP}/convert_hf_to_gguf.py", d, "--outtype", "f32", "--outfile", out],
                       env={**os.environ, "PYTHONPATH": f"{LLAMA_CPP}/gguf-py"}, capture_output=True, text=True)
    if r.returncode:
        print(fam, "llama.cpp converter failed:", r.stderr.strip().splitlines()[-1][:200], flush=True)
        continue
    try:
        runner = ModelRunner(ServerArgs(model_path=out, dtype="float32", max_total_tokens=512, max_running_requests=2,
                                        swa_full_tokens_ratio=1.0, cache_dir=os.path.join(root, "cache")))
        logits = RunnerDriver(runner).teacher_forced_logits(prompt, [])
        ref = hf_last_logits(load_hf(d), prompt)
        print(fam, "from GGUF: max |logit diff| vs transformers on the folder", float((logits[0] - ref).abs().max()), flush=True)
    except Exception as e:
        print(fam, "our GGUF load failed:", type(e).__name__, str(e)[:300], flush=True)
