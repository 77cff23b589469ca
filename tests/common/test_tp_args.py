"""The tensor-parallel flags: SGLang's spelling, and a bad combination is argparse's error."""

from __future__ import annotations

import pytest

from common.server_args import ServerArgs


def test_tp_flags_parse_with_sglang_names():
    args = ServerArgs.from_cli(["--model-path", "m", "--tp-size", "4", "--nnodes", "2", "--node-rank", "1",
                                "--dist-init-addr", "10.0.0.1:5000"])
    assert (args.tp_size, args.nnodes, args.node_rank, args.dist_init_addr) == (4, 2, 1, "10.0.0.1:5000")
    assert args.tp_ranks_per_node == 2
    assert ServerArgs(model_path="m").tp_size == 1


@pytest.mark.parametrize("flags, message", [
    (["--tp-size", "0"], "--tp-size must be >= 1"),
    (["--nnodes", "0"], "--nnodes must be >= 1"),
    (["--node-rank", "1"], "--node-rank must be in 0..0"),
    (["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "must be a multiple of --nnodes 2"),
    (["--tp-size", "2", "--nnodes", "2"], "--nnodes > 1 needs --dist-init-addr"),
    (["--dist-init-addr", "localhost"], "--dist-init-addr must be HOST:PORT"),
])
def test_a_bad_tp_combination_exits_2_with_the_reason(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ServerArgs.from_cli(["--model-path", "m", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: " in err and message in err
