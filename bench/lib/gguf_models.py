"""GGUF files written offline, for benchmarks and tests of the quantized
path: a Llama checkpoint (a Hugging Face state dict) in a chosen block type,
with the default model's tokenizer and chat template copied from its GGUF.

What llama.cpp's converter does for a Llama, done with gguf-py (whose
`quants.quantize` is the reference quantizer for Q8_0, Q4_0 and Q4_1): the
names mapped by gguf-py's table, q/k rows permuted into GGML's rotary
order, norms and 1-D tensors in float32, every matmul weight (and the
embedding) in `qtype`.

    python scripts/bench_gguf.py --model-dir DIR --qtype Q4_0 --out FILE
    python scripts/bench_gguf.py --bench-model llama1b --qtype Q4_0   # prints its path
"""

from __future__ import annotations

import json
import os

import gguf
import torch

from bench.lib import bench_models
from common.server_args import default_model_path
from model_proc.weights import load_state_dict

# the block types gguf-py can write (its quantizer has no K-quants)
QTYPES = ("F32", "BF16", "F16", "Q8_0", "Q4_0", "Q4_1")
# keys of the template not copied: the writer's own, and the shape of the template's model
_OWN_KEYS = ("GGUF.", "general.architecture", "general.file_type", "llama.")


def ggml_qk_order(rows: int, heads: int) -> torch.Tensor:
    """The row order llama.cpp's converter writes q/k in (each head's rotary
    halves interleaved): the inverse of quant.gguf_weights.llama_qk_order."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, 2, half).transpose(1, 2).reshape(-1)


def _copy_template_keys(writer: gguf.GGUFWriter, template: gguf.GGUFReader) -> None:
    for name, field in template.fields.items():
        if name.startswith(_OWN_KEYS):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)


def write_llama_gguf(model_dir: str, out: str, qtype: str, template: str | None = None,
                     with_tokenizer: bool = True) -> str:
    """`model_dir` (a Llama Hugging Face folder whose vocabulary is the
    template's) as a GGUF at `out` with its matmul weights in `qtype`.
    with_tokenizer=False: no tokenizer or chat template (a file only for
    reading its tensors back: the 49152 tokens take most of the writing)."""
    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {QTYPES}, not {qtype!r}")
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    if cfg["model_type"] != "llama":
        raise ValueError(f"only Llama checkpoints are written, not {cfg['model_type']!r}")
    writer = gguf.GGUFWriter(out, "llama")
    if with_tokenizer:
        _copy_template_keys(writer, gguf.GGUFReader(template or default_model_path()))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_vocab_size(cfg["vocab_size"])
    kind = gguf.GGMLQuantizationType[qtype]
    writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "BF16": gguf.LlamaFileType.MOSTLY_BF16,
                          "F16": gguf.LlamaFileType.MOSTLY_F16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                          "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[qtype])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    state = load_state_dict(model_dir)
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    for hf, t in state.items():
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"{hf}: no GGUF name for it")
        t = t.float()
        if hf.endswith(("q_proj.weight", "k_proj.weight")):
            t = t[ggml_qk_order(t.shape[0], heads if hf.endswith("q_proj.weight") else kv_heads)]
        data = t.numpy()
        if t.dim() == 2:
            data = gguf.quants.quantize(data, kind)
            writer.add_tensor(name, data, raw_dtype=kind)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def ensure_bench_gguf(family: str, qtype: str) -> str:
    """bench_models' `family` model (built first if missing) as a GGUF in `qtype`
    beside its folder, written once (through a temporary name, renamed into place)."""
    folder = bench_models.ensure(family)
    path = f"{folder}-{qtype}.gguf"
    if not os.path.exists(path) or os.path.getmtime(path) < os.path.getmtime(os.path.join(folder, "config.json")):
        print(f"writing {path}", flush=True)
        tmp = f"{path}.tmp{os.getpid()}"
        write_llama_gguf(folder, tmp, qtype)
        os.replace(tmp, path)
    return path
