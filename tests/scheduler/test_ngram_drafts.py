"""Draft proposers for NGRAM speculative decoding (scheduler_proc/speculative/ngram.py):
prompt lookup within one request, checked against a brute-force scan and for
incremental cost, and the bounded cross-request suffix table."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from scheduler_proc.speculative.ngram import PromptLookup, SuffixTable


def brute_force(tokens: list[int], min_window: int, max_window: int, max_drafts: int) -> list[int]:
    """The spec as a scan: longest window first, its latest earlier occurrence (one that has a token after it)."""
    if max_drafts <= 0:
        return []
    end = len(tokens)
    for n in range(max_window, min_window - 1, -1):
        if n >= end:
            continue
        suffix = tokens[end - n:]
        for start in range(end - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + max_drafts]
    return []


def test_prompt_lookup_longest_window_wins():
    # (5, 6) last occurred at 6..7 (followed by 9); (4, 5, 6) only at 1..3 (followed by 7)
    tokens = [0, 4, 5, 6, 7, 8, 5, 6, 9, 4, 5, 6]
    assert PromptLookup(1, 3).propose(tokens, 2) == [7, 8]
    assert PromptLookup(1, 2).propose(tokens, 2) == [9, 4]


def test_prompt_lookup_uses_the_most_recent_earlier_occurrence():
    tokens = [1, 2, 10, 1, 2, 20, 1, 2, 30, 1, 2]
    assert PromptLookup(2, 2).propose(tokens, 1) == [30]


def test_prompt_lookup_never_matches_the_suffix_itself():
    assert PromptLookup(1, 3).propose([1, 2, 3], 4) == []
    assert PromptLookup(1, 1).propose([7], 4) == []
    # an earlier occurrence that overlaps the suffix is a match: (7, 7) at 0..1, then 7
    assert PromptLookup(2, 2).propose([7, 7, 7], 4) == [7]


def test_prompt_lookup_cuts_at_max_drafts_and_at_the_end_of_the_tokens():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    pl = PromptLookup(1, 2)
    assert pl.propose(tokens, 3) == [3, 4, 5]
    assert pl.propose(tokens, 100) == [3, 4, 5, 6, 1, 2]  # stops where the tokens do
    assert pl.propose(tokens, 0) == []
    assert pl.propose(tokens, -1) == []


def test_prompt_lookup_on_empty_or_unmatched_tokens_proposes_nothing():
    assert PromptLookup(1, 4).propose([], 5) == []
    assert PromptLookup(1, 4).propose([1, 2, 3, 4, 5], 5) == []


def test_prompt_lookup_respects_min_window():
    tokens = [1, 9, 2, 3, 8, 3]  # only the 1-gram (3,) recurs
    assert PromptLookup(1, 3).propose(tokens, 2) == [8, 3]
    assert PromptLookup(2, 3).propose(tokens, 2) == []


def test_windows_are_validated():
    for lo, hi in [(0, 2), (3, 2)]:
        with pytest.raises(ValueError):
            PromptLookup(lo, hi)
        with pytest.raises(ValueError):
            SuffixTable(lo, hi, capacity=10)
    with pytest.raises(ValueError):
        SuffixTable(1, 2, capacity=0)


@pytest.mark.parametrize("min_window,max_window,vocab", [(1, 3, 3), (2, 4, 4), (1, 1, 5), (3, 5, 2)])
def test_incremental_growth_proposes_what_a_fresh_lookup_and_a_scan_do(min_window, max_window, vocab):
    rng = random.Random(0)
    seq = [rng.randrange(vocab) for _ in range(300)]
    grown: list[int] = []  # the same list, appended to
    pl_same, pl_copies = PromptLookup(min_window, max_window), PromptLookup(min_window, max_window)
    for length in range(len(seq) + 1):
        prefix = seq[:length]  # a fresh, equal-prefix copy each call
        max_drafts = rng.randrange(6)
        want = brute_force(prefix, min_window, max_window, max_drafts)
        assert PromptLookup(min_window, max_window).propose(prefix, max_drafts) == want, length
        assert pl_copies.propose(prefix, max_drafts) == want, length
        assert pl_same.propose(grown, max_drafts) == want, length
        if length < len(seq):
            grown.append(seq[length])


def test_growth_in_uneven_steps_matches_the_scan():
    rng = random.Random(0)
    seq = [rng.randrange(3) for _ in range(400)]
    pl = PromptLookup(1, 4)
    length = 0
    while length < len(seq):
        length = min(length + rng.randrange(1, 9), len(seq))  # prefill chunks, accepted drafts
        assert pl.propose(seq[:length], 5) == brute_force(seq[:length], 1, 4, 5), length


def test_prompt_lookup_rebuilds_when_given_fewer_tokens_than_it_indexed():
    pl = PromptLookup(1, 3)
    pl.propose([1, 2, 3, 1, 2, 3, 5, 6, 7, 8], 4)
    # a retracted request recomputed with different tokens: nothing of the old index may leak
    shorter = [5, 6, 9, 5, 6]
    assert pl.propose(shorter, 4) == PromptLookup(1, 3).propose(shorter, 4) == [9, 5, 6]
    # it keeps growing from the shorter list; the old index had (2, 3) ending at 6, which
    # would now point at a 3 that never followed (2, 3) in these tokens
    grown = shorter + [2, 3]
    assert pl.propose(grown, 4) == brute_force(grown, 1, 3, 4) == []
    grown += [7, 2]
    assert pl.propose(grown, 4) == brute_force(grown, 1, 3, 4) == [3, 7, 2]


class CountingList(list):
    """A token list that counts the elements read out of it (slices, items, iteration)."""

    reads = 0

    def __getitem__(self, i):  # type: ignore[override]
        got = super().__getitem__(i)
        self.reads += len(got) if isinstance(i, slice) else 1
        return got

    def __iter__(self) -> Iterator[int]:
        for t in super().__iter__():
            self.reads += 1
            yield t


def test_prompt_lookup_on_a_long_sequence_reads_only_the_new_tokens_and_the_suffix():
    # 18,000 tokens indexed once, then 2,000 one-token appends each followed by a
    # proposal: a rescan would read ~20,000 tokens per call, the index a few dozen
    min_window, max_window, max_drafts = 2, 4, 8
    rng = random.Random(0)
    tokens = CountingList(rng.randrange(50) for _ in range(18_000))
    pl = PromptLookup(min_window, max_window)
    pl.propose(tokens, max_drafts)
    tokens.reads = 0
    proposed = 0
    for _ in range(2_000):
        tokens.append(rng.randrange(50))
        proposed += len(pl.propose(tokens, max_drafts))
    windows = max_window - min_window + 1
    # per call: the new end's n-grams, the suffix's n-grams, the draft
    per_call = 2 * windows * max_window + max_drafts
    assert tokens.reads <= 2_000 * per_call
    assert proposed > 0  # the draft path was exercised, not only misses


def test_suffix_table_proposes_from_another_requests_output():
    table = SuffixTable(1, 3, capacity=100)
    table.add([10, 11, 12, 13, 14, 15])
    assert table.propose([99, 11, 12], 3) == [13, 14, 15]
    assert table.propose([99, 11, 12], 2) == [13, 14]
    assert table.propose([12], 10) == [13, 14, 15]  # the whole of `tokens` may be the key
    assert table.propose([99, 15], 3) == []  # the output's last token has nothing after it
    assert table.propose([99, 11, 12], 0) == []
    assert table.propose([], 3) == []


def test_suffix_table_prefers_the_longest_suffix_and_the_latest_output():
    table = SuffixTable(1, 3, capacity=100)
    table.add([1, 2, 3, 40])
    table.add([7, 2, 3, 50, 51])
    assert table.propose([0, 2, 3], 2) == [50, 51]  # (2, 3) last seen in the second output
    assert table.propose([1, 2, 3], 2) == [40]  # (1, 2, 3) is longer
    table.add([9, 2, 3, 60])
    assert table.propose([0, 2, 3], 2) == [60]


def test_suffix_table_caps_the_continuation():
    table = SuffixTable(1, 1, capacity=100, max_continuation=4)
    table.add(list(range(20)))
    assert table.propose([0], 10) == [1, 2, 3, 4]


def test_suffix_table_holds_at_most_capacity_entries_and_drops_the_oldest_added():
    table = SuffixTable(1, 1, capacity=3)
    table.add([1, 2, 3, 4, 5])  # keys (1,) (2,) (3,) (4,): (1,) is dropped
    assert len(table) == 3
    assert table.propose([1], 1) == []
    assert [table.propose([k], 1) for k in (2, 3, 4)] == [[3], [4], [5]]
    table.add([2, 6])  # (2,) re-added: now the youngest, so (3,) goes next
    table.add([7, 8])
    assert len(table) == 3
    assert table.propose([3], 1) == []
    assert [table.propose([k], 1) for k in (2, 4, 7)] == [[6], [5], [8]]


def test_suffix_table_stays_bounded_under_many_outputs():
    rng = random.Random(0)
    table = SuffixTable(1, 4, capacity=500)
    for _ in range(200):
        table.add([rng.randrange(30) for _ in range(rng.randrange(0, 60))])
        assert len(table) <= 500
    assert len(table) == 500
