"""One request to the scheduler, as the API layers (native and OpenAI) build it."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.messages import SamplingParams


@dataclass
class RequestSpec:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stop: list[str] = field(default_factory=list)  # stop strings, matched here on the text
    stop_regex: list[str] = field(default_factory=list)  # stop regexes, likewise
    no_stop_trim: bool = False  # the matched stop string (or stop token) stays in the text
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # >= 0 (with return_logprob): prompt logprobs from this position
    group: str | None = None  # the client request's id when it fanned out into several
    cache_salt: str = ""  # requests with different salts never share cached prefixes
    timeout_s: float | None = None  # deadline, seconds from arrival (None: the server's default)
    priority: int = 0  # with --enable-priority-scheduling: larger goes first

    @property
    def matches_text(self) -> bool:
        """Stop strings or regexes are matched here, on the text."""
        return bool(self.stop or self.stop_regex)


def fan_out_rids(base: str, count: int) -> list[str]:
    """The rids of `count` requests made from one client rid: the rid itself
    when alone, else rid-0, rid-1, ..."""
    return [base] if count == 1 else [f"{base}-{k}" for k in range(count)]


def seed_for_sample(seed: int | None, k: int) -> int | None:
    """n samples of one seeded prompt: seed+k for the k-th, so they differ from
    one another and the whole answer stays reproducible."""
    return None if seed is None else seed + k
