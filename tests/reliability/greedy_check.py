"""Comparing a greedy answer with its reference when lengths may differ.

The reference of a prompt is one greedy run with the largest max_new_tokens
used; a request with a smaller budget must match its prefix. Greedy outputs
are compared by `tests.helpers.greedy_parting` (identical, or parting once
at a near-tie, after which nothing is compared).
"""

from __future__ import annotations

from typing import Any

from tests.helpers import greedy_parting


def ids_and_tops(answer: dict[str, Any]) -> tuple[list[int], list[list[int]]]:
    """Output ids and, per position, the top-n ids from a native answer made
    with return_logprob and top_logprobs_num."""
    tops = answer["meta_info"]["output_top_logprobs"]
    return list(answer["output_ids"]), [[entry[1] for entry in pos] for pos in tops]


def check_against_reference(answer: dict[str, Any], max_new_tokens: int,
                            reference: dict[str, Any]) -> int | None:
    """Asserts `answer` is the reference's greedy output (cut at
    max_new_tokens), up to a near-tie parting; returns the parting position
    or None. A reference that stopped early (EOS) must stop the answer at the
    same place unless they parted before."""
    ours, ours_top = ids_and_tops(answer)
    ref, ref_top = ids_and_tops(reference)
    n = min(len(ours), len(ref))
    parting = greedy_parting(ours[:n], ours_top[:n], ref[:n], ref_top[:n])
    if parting is None:
        expected = min(max_new_tokens, len(ref))
        assert len(ours) == expected, (
            f"same tokens but {len(ours)} of them, expected {expected} "
            f"(reference {reference['meta_info']['finish_reason']}, "
            f"ours {answer['meta_info']['finish_reason']})")
    return parting
