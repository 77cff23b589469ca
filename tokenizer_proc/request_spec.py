"""One request to the scheduler, as the API layers (native and OpenAI) build it."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.messages import TokenizedGenerateReq


@dataclass
class RequestSpec:
    """The message for the scheduler (`req`: everything the scheduler uses,
    one source of truth for those fields), plus what only this process uses:
    stop strings and regexes are matched here, on the text, and `group` ties
    together the requests one client body fanned out into."""

    req: TokenizedGenerateReq
    stop: list[str] = field(default_factory=list)  # stop strings, matched here on the text
    stop_regex: list[str] = field(default_factory=list)  # stop regexes, likewise
    no_stop_trim: bool = False  # the matched stop string (or stop token) stays in the text
    group: str | None = None  # the client request's id when it fanned out into several

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
