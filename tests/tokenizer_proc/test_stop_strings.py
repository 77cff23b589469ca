from __future__ import annotations

import random

import pytest

from tokenizer_proc.stop_strings import StopStringMatcher, compile_stop_regex


def run(stops: list[str], pieces: list[str], regexes: list[str] | None = None,
        keep: bool = False) -> tuple[list[str], str | None]:
    m = StopStringMatcher(stops, regexes, keep=keep)
    shown = [m.feed(p) for p in pieces]
    shown.append(m.flush())
    return shown, m.matched


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_stop_split_across_pieces_is_held_back_and_trimmed() -> None:
    shown, matched = run(["STOP"], ["hello S", "T", "OP and more"])
    assert shown == ["hello ", "", "", ""]
    assert matched == "STOP"


def test_false_start_is_released() -> None:
    shown, matched = run(["STOP"], ["a ST", "x b", "c"])
    assert shown == ["a ", "STx b", "c", ""]
    assert matched is None


def test_held_text_is_released_at_the_end() -> None:
    shown, matched = run(["\n\nUser:"], ["answer\n", "\nUs"])
    assert "".join(shown[:-1]) == "answer"
    assert shown[-1] == "\n\nUs" and matched is None


def test_nothing_after_a_match() -> None:
    m = StopStringMatcher(["x"])
    assert m.feed("abxcd") == "ab"
    assert m.feed("more") == "" and m.flush() == "" and m.matched == "x"


@pytest.mark.parametrize("seed", range(30))
def test_result_does_not_depend_on_chunking(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "abc "
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choice(alphabet) for _ in range(40))
    whole, matched = run(stops, [text])
    expect = "".join(whole)
    for _ in range(5):
        shown, m2 = run(stops, random_split(text, rng))
        assert "".join(shown) == expect and m2 == matched
    if matched is not None:
        assert text.startswith(expect)
        assert not any(s in expect for s in stops)  # never shows a whole stop string...
        rest = text[len(expect):]
        assert any(rest.startswith(s) for s in stops)  # ...and is cut right before one
    else:
        assert expect == text


def test_earliest_ending_match_wins() -> None:
    assert run(["abcd", "c"], ["xxabcd"])[1] == "c"
    assert run(["ab", "b"], ["xab"])[1] == "ab"  # same end: the longer one


def test_no_stop_trim_keeps_the_stop_string_and_drops_what_follows() -> None:
    shown, matched = run(["STOP"], ["hello S", "T", "OP and more"], keep=True)
    assert "".join(shown) == "hello STOP" and matched == "STOP"


def test_a_regex_is_held_back_while_it_could_still_match() -> None:
    shown, matched = run([], ["call 55", "5-12", "34 now"], regexes=[r"\d{3}-\d{4}"])
    assert shown == ["call ", "", "", ""] and matched == r"\d{3}-\d{4}"
    shown, matched = run([], ["call 55", "5-1x", " ok"], regexes=[r"\d{3}-\d{4}"])
    assert "".join(shown) == "call 555-1x ok" and matched is None
    assert shown[1] == "555-1x"  # released as soon as it could no longer match
    shown, matched = run([], ["id: 555-1234!"], regexes=[r"\d{3}-\d{4}"], keep=True)
    assert "".join(shown) == "id: 555-1234" and matched == r"\d{3}-\d{4}"


@pytest.mark.parametrize("seed", range(30))
def test_regex_result_does_not_depend_on_chunking(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab1 "
    regexes = [rng.choice([r"a\db", r"b+1", r"1 ?a", r"\d\d", r"ba[ab]"]) for _ in range(rng.randint(1, 2))]
    stops = [rng.choice(["aa", "b b", "11a"])] if rng.random() < 0.5 else []
    text = "".join(rng.choice(alphabet) for _ in range(40))
    whole, matched = run(stops, [text], regexes)
    expect = "".join(whole)
    for _ in range(5):
        shown, m2 = run(stops, random_split(text, rng), regexes)
        assert "".join(shown) == expect and m2 == matched
    assert text.startswith(expect)


# The patterns: catastrophic backtracking on any text without \x00..\x08
CATASTROPHIC = [rf"(?:[\s\S][\s\S]?)*[\x00\x0{k}]" for k in range(1, 9)]


def test_catastrophic_patterns_take_linear_time() -> None:
    """A backtracking engine takes exponential time on these (seconds for a
    few hundred characters); RE2's searches are linear in the text."""
    import time

    m = StopStringMatcher([], CATASTROPHIC + [r"(.*a){20}b", r"(a|aa)+c", r"(x+x+)+y"])
    rng = random.Random(0)
    start = time.thread_time()
    for _ in range(150):
        m.feed("".join(rng.choice("a x\n") for _ in range(rng.randint(1, 8))))
    assert m.matched is None
    assert time.thread_time() - start < 2.0  # about 10 ms; a backtracking engine: minutes


@pytest.mark.parametrize("pattern, feature", [
    (r"(a)\1", "backreferences"), (r"(?P<x>a)(?P=x)", "backreferences"),
    (r"a(?=b)", "lookahead"), (r"a(?!b)", "lookahead"), (r"(?<=a)b", "lookbehind"),
    (r"(?<!a)b", "lookbehind"), (r"(a)?(?(1)b|c)", "conditional groups"),
    (r"(?>ab)c", "atomic groups"), (r"a*+b", "possessive repeats"),
])
def test_what_re2_cannot_take_is_refused_naming_it(pattern: str, feature: str) -> None:
    with pytest.raises(ValueError, match=feature):
        compile_stop_regex(pattern)


@pytest.mark.parametrize("pattern, reason", [
    ("(", "not a valid regular expression"), ("a" * 513, "longer than 512"),
    ("a*", "matches the empty string"), ("(?:a{999}){50}", "RE2 cannot compile it: invalid repetition size"),
    ("[a-z]{999}[0-9]{999}[A-Z]{999}", "too complex"),
])
def test_bad_patterns_are_refused_with_the_reason(pattern: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        compile_stop_regex(pattern)


def test_flags_and_escapes_mean_what_they_mean_in_python() -> None:
    assert run([], ["say HeLLo there"], regexes=["(?i)hello"])[1] == "(?i)hello"
    assert run([], ["a\nb"], regexes=["a.b"])[1] is None
    assert run([], ["a\nb"], regexes=["(?s)a.b"])[1] == "(?s)a.b"
    assert run([], ["x\nend"], regexes=["(?m)^end"])[1] == "(?m)^end"
    shown, matched = run([], ["cost: ", "$5.", "00!"], regexes=[r"\$\d+\.\d\d"])
    assert matched is not None and "".join(shown) == "cost: "
    assert run([], ["a-]b"], regexes=[r"[\]\-]b"])[1] is not None
    assert run([], ["caf\u00e9!"], regexes=["\u00e9!"])[1] is not None


def random_pattern(rng: random.Random, depth: int = 0) -> str:
    atoms = ["a", "b", "[ab]", "[^a]", ".", r"\d", "1", " ", "(?:ab|b)", "(?i:A)", r"\w", r"\s",
             r"[^\d ]", "(?s:.)"]
    parts = []
    for _ in range(rng.randint(1, 2)):
        r = rng.random()
        if r < 0.6 or depth > 1:
            x = rng.choice(atoms)
        elif r < 0.8:
            x = f"(?:{random_pattern(rng, depth + 1)}|{random_pattern(rng, depth + 1)})"
        else:
            x = f"(?:{random_pattern(rng, depth + 1)})"
        parts.append(x + rng.choice(["", "", "*", "+", "?", "{2}", "{1,3}", "{0,2}"]))
    return "".join(parts)


def test_partial_matches_agree_with_a_backtracking_engine() -> None:
    """Where a match could still begin (what is held back) and where a match
    begins, against the `regex` module's partial matching on random patterns.
    (Lazy repeats and \\b are left out: there `regex`'s partial matching is
    wrong, and RE2's answer the right one.)"""
    import regex

    rng, checked = random.Random(7), 0
    for _ in range(1500):
        pattern = random_pattern(rng)
        try:
            ours = compile_stop_regex(pattern)
        except ValueError:
            continue  # matches the empty string
        theirs = regex.compile(pattern)
        for _ in range(4):
            buf = "".join(rng.choice("ab1 xA\n") for _ in range(rng.randint(1, 8)))
            expect, got = theirs.search(buf), ours.match.search(buf)
            assert (expect is None) == (got is None), (pattern, buf)
            if expect is not None:  # the same start; the end may differ only where
                assert expect.start() == got.start(), (pattern, buf)  # a loop's body matches ""
                continue
            partial = theirs.search(buf, partial=True)
            held = len(buf) - partial.start() if partial is not None else 0
            assert len(buf) - ours.prefix.search(buf).start() == held, (pattern, buf)
            checked += 1
    assert checked > 1000


def test_work_per_token_does_not_grow_with_the_output() -> None:
    """A 20k-token stream past stop strings that keep almost matching and a
    regex whose partial match never ends: each feed examines the new text (per
    stop string) and at most the bounded hold-back, at the end as at the start."""
    from tokenizer_proc.stop_strings import MAX_REGEX_HOLD_CHARS

    stops, regexes = ["abcabd", "x" * 1000], [r"BEGIN[^!]*END"]
    m = StopStringMatcher(stops, regexes)
    rng = random.Random(0)
    pieces = ["BEGIN "] + [rng.choice(["abcab", "ab", "c", "xx", " word", "\n"]) for _ in range(20_000)]
    shown, per_feed = [], []
    for p in pieces:
        before = m.scanned
        shown.append(m.feed(p))
        per_feed.append(m.scanned - before)
        assert len(m.pending) <= MAX_REGEX_HOLD_CHARS
    shown.append(m.flush())
    assert m.matched is None and "".join(shown) == "".join(pieces)
    longest_piece = max(len(p) for p in pieces)
    # stop strings read the new text once each; each regex searches the held text twice
    bound = len(stops) * longest_piece + 2 * len(regexes) * (MAX_REGEX_HOLD_CHARS + longest_piece)
    assert max(per_feed) <= bound
    first, last = per_feed[1000:2000], per_feed[-1000:]
    assert sum(last) <= 1.1 * sum(first)  # flat, not growing with the output


def test_a_regex_match_longer_than_the_hold_back_is_not_found() -> None:
    from tokenizer_proc.stop_strings import MAX_REGEX_HOLD_CHARS

    body = "a" * (MAX_REGEX_HOLD_CHARS + 10)
    shown, matched = run([], ["<<", body, ">>"], regexes=[r"<<a*>>"])
    assert matched is None and "".join(shown) == "<<" + body + ">>"
    shown, matched = run([], ["<<", "a" * 10, ">>"], regexes=[r"<<a*>>"])
    assert matched == r"<<a*>>" and "".join(shown) == ""


def test_a_long_stop_string_is_found_across_many_pieces() -> None:
    stop = "ab" * 400 + "c"
    text = "ab" * 1000 + "c tail"
    shown, matched = run([stop, "zz"], [text[i:i + 3] for i in range(0, len(text), 3)])
    assert matched == stop and "".join(shown) == text[:text.index(stop)]


def test_an_empty_first_piece_is_fine() -> None:
    """The `regex` module's partial search of "" with this pattern segfaulted
    the front end (a first token that adds no text: half a character, a
    skipped special token)."""
    shown, matched = run([], ["", "xyA", "", "b"], regexes=[r"(?s:.)+A{0,2}"])
    assert matched == r"(?s:.)+A{0,2}" and "".join(shown) == ""
