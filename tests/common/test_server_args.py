"""ServerArgs from the command line: a bad value is argparse's error, not a traceback."""

from __future__ import annotations

import pytest

from common.server_args import ServerArgs


@pytest.mark.parametrize("flags, message", [
    (["--max-running-requests", "0"], "--max-running-requests must be >= 1"),
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static must be in (0, 1]"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be positive"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "1"],
     "--speculative-num-draft-tokens must be >= 2"),
    (["--speculative-algorithm", "NGRAM", "--deterministic"], "--speculative-algorithm and --deterministic do not"),
    (["--speculative-algorithm", "NGRAM", "--batching", "static"], "--speculative-algorithm needs --batching"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size", "5",
      "--speculative-ngram-max-match-window-size", "3"], "--speculative-ngram-min-match-window-size must be"),
])
def test_a_bad_value_exits_2_with_the_usage_line_and_the_reason(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ServerArgs.from_cli(["--model-path", "m", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and f"error: {message}" in err and "Traceback" not in err
