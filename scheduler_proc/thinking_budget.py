"""A reasoning model's thinking budget (SGLang's and Qwen's `thinking_budget`):
after that many thinking tokens the closing tag is forced, so the model must
answer.

The scheduler decides every token, so forcing is a mask, as a grammar's is
(scheduler_proc/grammar.py): while the tag is being forced, the request's
row is constrained to the tag's next token. A row is counted here over the
tokens it keeps; like a grammar, the step that may end its free thinking is
not overlapped with the next (`forces_soon`), so the forced tag follows
exactly `budget` thinking tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from common.messages import ThinkingBudgetSpec


class ThinkingPhase(enum.Enum):
    WAITING_START = "waiting_start"  # the first output token says whether it thinks
    THINKING = "thinking"  # counting thinking tokens
    FORCING = "forcing"  # the closing tag's tokens, one a step
    DONE = "done"  # closed (by the model or forced), or never opened


@dataclass(slots=True)
class ThinkingBudget:
    budget: int
    end_ids: list[int]
    start_id: int
    vocab_size: int  # the model's logits width: a forced row's mask has one bit per token
    phase: ThinkingPhase
    count: int = 0  # thinking tokens so far
    forced: int = 0  # end_ids given so far while forcing

    @classmethod
    def from_spec(cls, spec: ThinkingBudgetSpec, vocab_size: int) -> ThinkingBudget:
        phase = ThinkingPhase.WAITING_START if spec.start_id >= 0 else ThinkingPhase.THINKING
        tb = cls(spec.budget, list(spec.end_ids), spec.start_id, vocab_size, phase)
        tb._force_if_spent()
        return tb

    def error(self, vocab_size: int, has_grammar: bool) -> str | None:
        """Why the request cannot run (the tokenizer process checks as much:
        a scheduler never trusts a peer), or None."""
        if has_grammar:
            return "a thinking budget and a grammar cannot constrain the same request"
        if self.budget < 0 or not self.end_ids or not all(0 <= t < vocab_size for t in self.end_ids) \
                or self.start_id >= vocab_size:
            return "thinking_budget: a budget >= 0 and closing-tag token ids in the vocabulary are needed"
        return None

    def _force_if_spent(self) -> None:
        if self.phase is ThinkingPhase.THINKING and self.count >= self.budget:
            self.phase = ThinkingPhase.FORCING

    def accept(self, output_ids: list[int]) -> None:
        """After a token was appended to the output."""
        token = output_ids[-1]
        if self.phase is ThinkingPhase.WAITING_START:
            self.phase = ThinkingPhase.THINKING if token == self.start_id else ThinkingPhase.DONE
            self._force_if_spent()
        elif self.phase is ThinkingPhase.THINKING:
            n = len(self.end_ids)
            if output_ids[-n:] == self.end_ids:
                self.phase = ThinkingPhase.DONE  # the model closed it itself
                return
            self.count += 1
            self._force_if_spent()
        elif self.phase is ThinkingPhase.FORCING:
            self.forced += 1
            if self.forced == len(self.end_ids):
                self.phase = ThinkingPhase.DONE

    @property
    def forced_next(self) -> int | None:
        """The token the next step must sample, if forced."""
        return self.end_ids[self.forced] if self.phase is ThinkingPhase.FORCING else None

    def draft_room(self) -> int | None:
        """How many drafts a speculative verify step may check after this
        row's next token (None: no limit of the budget's). Its tokens are
        sampled freely, so they must all be thinking tokens within the budget
        (or follow a closed block): a row that has yet to say whether it
        thinks, or whose tag is being forced, decodes a token a step."""
        if self.phase is ThinkingPhase.DONE:
            return None
        if self.phase is ThinkingPhase.THINKING:
            return max(0, self.budget - self.count - 1)
        return 0

    def forces_soon(self, pending: int) -> bool:
        """With `pending` tokens in flight, the token after them may be forced:
        the next step must wait for them (no overlap)."""
        if self.phase is ThinkingPhase.FORCING:
            return True
        if self.phase is ThinkingPhase.DONE:
            return False
        return self.count + pending >= self.budget


def allow_only(bitmask, row: int, token: int) -> None:
    """In an xgrammar bitmask (ForwardBatch.grammar_bitmask's layout: int32
    words, bit t % 32 of word t // 32 for token t), row `row` allows `token` alone."""
    bitmask[row] = 0
    bit = token % 32
    bitmask[row, token // 32] = (1 << bit) if bit < 31 else -(1 << 31)  # int32: bit 31 is the sign
