"""CheckpointReader: a tensor's rows or columns read straight from the
safetensors files equal the same slice of the whole tensor, sharded
checkpoints included; a missing weight is named."""

from __future__ import annotations

import pytest
import torch

from model_proc.weights import CheckpointReader, load_state_dict


def test_sliced_reads_equal_slices_of_the_whole_tensor_over_a_sharded_checkpoint(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).save_pretrained(tmp_path, max_shard_size="100KB")
    whole = load_state_dict(tiny_llama_dir)
    with CheckpointReader(str(tmp_path)) as ckpt:
        assert sorted(ckpt.names()) == sorted(whole)
        assert ckpt.numel() == sum(t.numel() for t in whole.values())
        q = whole["model.layers.1.self_attn.q_proj.weight"]
        assert ckpt.shape("model.layers.1.self_attn.q_proj.weight") == list(q.shape)
        assert torch.equal(ckpt.read("model.layers.1.self_attn.q_proj.weight", 0, 16, 48), q[16:48])
        o = whole["model.layers.0.self_attn.o_proj.weight"]
        assert torch.equal(ckpt.read("model.layers.0.self_attn.o_proj.weight", 1, 32, 64), o[:, 32:64])
        assert torch.equal(ckpt.read("model.norm.weight"), whole["model.norm.weight"])
        with pytest.raises(ValueError, match="'lm_head.bias' missing from the checkpoint"):
            ckpt.read("lm_head.bias")


@pytest.mark.parametrize("edit, reason", [
    (("drop", "model.layers.1.mlp.up_proj.weight"), "'model.layers.1.mlp.up_proj.weight' missing"),
    (("rows", "model.layers.0.self_attn.k_proj.weight"), "'model.layers.0.self_attn.k_proj.weight' has the wrong shape"),
    (("cols", "model.layers.1.self_attn.o_proj.weight"), "'model.layers.1.self_attn.o_proj.weight' has the wrong shape"),
    (("rows", "model.layers.0.post_attention_layernorm.weight"),
     "'model.layers.0.post_attention_layernorm.weight' has the wrong shape"),
    (("rows", "model.embed_tokens.weight"), "'model.embed_tokens.weight' has the wrong shape"),
], ids=["missing", "k_proj_rows", "o_proj_columns", "norm", "embedding"])
def test_a_missing_or_misshapen_tensor_stops_the_load_naming_it(edit, reason, tiny_llama_dir, tmp_path, make_runner):
    """A ValueError (which the model process reports as one 'cannot start'
    line) naming the tensor, whatever the tensor."""
    import shutil

    from safetensors.torch import save_file

    shutil.copy(f"{tiny_llama_dir}/config.json", tmp_path / "config.json")
    tensors = load_state_dict(tiny_llama_dir)
    what, name = edit
    if what == "drop":
        del tensors[name]
    elif what == "rows":
        tensors[name] = tensors[name][:-1].clone()
    else:
        tensors[name] = tensors[name][:, :-1].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=reason):
        make_runner(str(tmp_path))
