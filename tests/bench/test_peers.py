"""bench/serving/peers.py: one trace, this server and a peer side by side, with the floors."""

from __future__ import annotations

import json
import os

import dataclasses

import pytest

from bench.lib import machine_rates
from bench.serving import peers
from common import server_args
from model_proc.model import ModelConfig
from tests.helpers import TINY_CONFIG


def test_this_server_and_a_peer_are_served_the_same_trace(tmp_path, default_model_dir, recorded, monkeypatch,
                                                           shared_server) -> None:
    # the floors' matmul rate still measured, on 256 x 256 matrices: at the default
    # 2048 a call takes seconds (in bfloat16 without native bfloat16 units, a minute), six calls
    monkeypatch.setattr(peers, "matmul_rate", lambda dtype: machine_rates.matmul_rate(dtype, n=256))
    # the peer is another server of ours, the session's shared one (tests/conftest.py):
    # any OpenAI-completions server would do
    out = peers.main(["--concurrency", "2", "1", "--num-prompts", "4", "--num-prompts-single", "2",
                      "--input-len", "16", "--output-len", "8", "--ours-flags", "--max-running-requests 4",
                      "--peer", f"other={shared_server.url}", "--peer-note", "other=a second batchserve",
                      "--peer-model", f"other={default_model_dir}", "--out-dir", str(tmp_path), "--record"])
    assert [(r["server"], r["concurrency"], r["prompts"]) for r in out["rows"]] == [
        ("batchserve", 2, 4), ("batchserve", 1, 2), ("other", 2, 4), ("other", 1, 2)]
    for r in out["rows"]:
        assert r["failed"] == 0 and r["output_throughput"] > 0
        assert r["floor_output_throughput"] > 0 and 0 < r["share_of_compute_floor"]
        assert (r["floor_itl_ms"] is not None) == (r["concurrency"] == 1)
    # 1 concurrent, each server's memory floor is what it serves: ours the GGUF's blocks, the
    # peer (--peer-model) the float32 folder's safetensors
    bandwidth = out["floors"]["bandwidth_gbs"] * 1e9
    floors = {r["server"]: r["floor_itl_ms"] for r in out["rows"] if r["concurrency"] == 1}
    assert floors["batchserve"] == pytest.approx(out["floors"]["gguf_floor_itl_ms"])
    assert floors["other"] == pytest.approx(1e3 * peers.served_bytes(default_model_dir) / bandwidth)
    assert floors["other"] > 2 * floors["batchserve"]  # float32 against 4-bit blocks
    md = (tmp_path / "peers.md").read_text()
    assert "| other | 1 | 2 |" in md and "- other: a second batchserve" in md
    assert "--peer-note 'other=a second batchserve'" in out["command"]  # runs as it reads
    assert json.loads((tmp_path / "peers.json").read_text())["rows"] == out["rows"]
    assert os.path.exists(tmp_path / "peers-server.log")
    record = recorded.check("bench.serving.peers")  # --record
    assert record.data == json.loads(json.dumps(out)) and record.floors == out["floors"]


def test_trace_flops_count_layers_head_and_attention() -> None:
    cfg = ModelConfig.from_dict({**TINY_CONFIG, "model_type": "llama"})
    d, h, L = cfg.head_dim, cfg.num_heads, cfg.num_layers
    q, kv = h * d, cfg.num_kv_heads * d
    body = L * (cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size)
    head = cfg.vocab_size * cfg.hidden_size
    # 3 prompt tokens, 2 outputs: 4 tokens go through the layers, 2 sample
    expected = 2 * body * 4 + 2 * head * 2 + 4 * d * h * L * (1 + 2 + 3 + 4)
    assert peers.trace_flops(cfg, [3], [2]) == expected
    assert peers.weight_bytes(cfg, 2) == 2 * (body + head)


def test_trace_flops_count_only_the_window_on_sliding_layers() -> None:
    full = ModelConfig.from_dict({**TINY_CONFIG, "model_type": "llama"})
    sliding = dataclasses.replace(full, layer_windows=(2, None))
    assert [peers.pairs_attended(4, w) for w in (None, 4, 2)] == [1 + 2 + 3 + 4, 1 + 2 + 3 + 4, 1 + 2 + 2 + 2]
    per_pair = 4 * full.head_dim * full.num_heads  # one layer
    assert peers.trace_flops(full, [3], [2]) - peers.trace_flops(sliding, [3], [2]) == per_pair * (10 - 7)


def test_a_short_model_name_is_read_as_the_server_reads_it(default_model_dir, monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(server_args.MODEL_SHORT_NAMES, "tiny-name", lambda: default_model_dir)
    monkeypatch.chdir(tmp_path)  # no file of that name here
    assert peers.model_folder("tiny-name") == default_model_dir
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 1000)
    assert peers.gguf_floor(str(gguf), bandwidth=1e6) == {"gguf_mb": 1e-3, "gguf_floor_itl_ms": 1.0}
    assert peers.gguf_floor(default_model_dir, bandwidth=1e6) == {}


def test_a_peer_model_is_read_as_its_file_or_its_folders_safetensors(tmp_path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"x" * 100)
    folder = tmp_path / "folder"
    folder.mkdir()
    for name, size in (("a.safetensors", 30), ("b.safetensors", 12), ("tokenizer.json", 1000)):
        (folder / name).write_bytes(b"x" * size)
    assert peers.served_bytes(str(tmp_path / "model.gguf")) == 100
    assert peers.served_bytes(str(folder)) == 42
