"""new_token_ratio: the share of their remaining max_new_tokens that running
requests are expected to still decode, which admission reserves KV for."""

from __future__ import annotations

from scheduler_proc.req import Req

# SGLang's defaults: start at 0.7 (times --schedule-conservativeness), decay
# over 600 decode steps to 0.14 of that; after a retraction, jump to an
# estimate that assumes every remaining row decodes RETRACT_DECODE_STEPS more.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20


class NewTokenRatio:
    """Optimistic while decode steps go through, pessimistic after a retraction."""

    def __init__(self, schedule_conservativeness: float) -> None:
        self.init = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        self.min = min(self.init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.decay_step = (self.init - self.min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.value = self.init

    def reset(self) -> None:
        """The server went idle, or the cache was flushed."""
        self.value = self.init

    def decay(self) -> None:
        """A decode step found a slot for every row."""
        self.value = max(self.value - self.decay_step, self.min)

    def after_retraction(self, remaining: list[Req]) -> float:
        """Raise the ratio to what the rows left after a retraction need if each
        decodes RETRACT_DECODE_STEPS more tokens; returns the old value."""
        old = self.value
        if remaining:
            decoded = sum(len(r.output_ids) for r in remaining)
            max_new = sum(r.sampling_params.max_new_tokens for r in remaining)
            estimate = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(remaining)) / max(max_new, 1))
            self.value = max(estimate, old)
        return old
