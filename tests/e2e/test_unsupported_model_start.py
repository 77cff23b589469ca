"""A model the server does not run stops the start with the reason on one
line (model_config.py's refusals reach the user through model_proc's
"cannot start"), never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.server_process import ROOT, free_port
from tests.helpers import make_tiny_llama


@pytest.mark.parametrize("model_type, config_edit, reason", [
    ("gemma3_text", {"layer_types": ["chunked_attention", "full_attention"]},
     "layer type 'chunked_attention' is not supported"),
    ("qwen3", {"num_experts": 8}, "mixture-of-experts models are not supported (num_experts=8)"),
], ids=["unknown_layer_type", "experts"])
def test_an_unsupported_config_stops_the_start_with_one_line(model_type, config_edit, reason, tmp_path):
    folder = make_tiny_llama(str(tmp_path), model_type=model_type)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **config_edit}, f)
    out = subprocess.run([sys.executable, "launch.py", "--model-path", folder, "--port", str(free_port())],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if reason in line]
    assert len(lines) == 1 and "cannot start: " in lines[0], out.stderr
    assert "Traceback" not in out.stderr
