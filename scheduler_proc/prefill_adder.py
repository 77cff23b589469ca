"""PrefillAdder: the admission budget of one prefill batch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scheduler_proc.req import Req


@dataclass
class PrefillAdder:
    """Admits waiting requests while every budget holds.

    `rem_total_tokens` starts as the free KV slots minus what the running
    requests are still expected to need (remaining new tokens times
    `new_token_ratio`); each admitted request takes its prompt plus its own
    expected remainder out of it.
    """

    rem_running: int  # free places in the running batch
    rem_total_tokens: float  # KV slots not promised to anyone
    rem_prefill_tokens: int  # tokens this prefill batch may still compute
    new_token_ratio: float
    can_run: list[Req] = field(default_factory=list)

    @classmethod
    def for_step(cls, *, max_running: int, num_running: int, free_slots: int,
                 running: list[Req], max_prefill_tokens: int,
                 new_token_ratio: float) -> "PrefillAdder":
        reserved = sum(cls.expected_new_tokens(r, new_token_ratio) for r in running)
        return cls(rem_running=max_running - num_running,
                   rem_total_tokens=free_slots - reserved,
                   rem_prefill_tokens=max_prefill_tokens,
                   new_token_ratio=new_token_ratio)

    @staticmethod
    def expected_new_tokens(req: Req, ratio: float) -> int:
        return math.ceil(req.remaining_new_tokens * ratio)

    def try_add(self, req: Req) -> bool:
        """Admit `req` if it fits; False means stop adding (keep queue order)."""
        if self.rem_running <= 0:
            return False
        extend = req.seq_len - req.kv_len
        need = extend + self.expected_new_tokens(req, self.new_token_ratio)
        if need > self.rem_total_tokens:
            return False
        # One request longer than the prefill budget still runs, alone.
        if extend > self.rem_prefill_tokens and self.can_run:
            return False
        self.can_run.append(req)
        self.rem_running -= 1
        self.rem_total_tokens -= need
        self.rem_prefill_tokens -= extend
        return True
