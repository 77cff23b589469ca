"""When a decode step verifies drafts, and how many per row.

A decode step on a CPU costs about a fixed part (the weights streamed once,
the per-step overheads) plus a part per token. Verifying k drafts adds k
tokens to a row's step; they pay when the tokens they are expected to add
outweigh the time they add. Per step, the Speculator takes each row's
drafts (ngram.py) and keeps the draft tokens in order of their expected
gain, a row's j-th draft being kept with probability `accept_rate ** j`
(the row's acceptance, an EMA of its verifies), while the step's expected
tokens per second still rise. The step's cost line starts from the model
process's start-up measurement (ModelInfo.step_cost) and follows the steps'
measured forward times (StepCost). A large batch therefore stops
speculating by itself: its fixed part is shared by many rows already, so
drafts add cost without adding much rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.server_args import ServerArgs
from scheduler_proc.req import Req
from scheduler_proc.speculative.ngram import PromptLookup, SuffixTable

EMA_WEIGHT = 0.3  # a verify's weight in a row's acceptance rate
PRIOR_ACCEPT_RATE = 0.5  # a row's rate before its first verify (then the server-wide rate)
# a row whose drafts were passed over moves this share of the way back to the
# server-wide rate each step: its drafts may have become good since (a quote)
RETRY_DRIFT = 0.05
# the cost line when the model did not measure one (an in-process test model):
# a 2-core CPU's small model, 20 ms a step plus 1 ms a token
DEFAULT_STEP_COST = (0.02, 0.001)


class StepCost:
    """seconds(step) ~ fixed + per_token * tokens, a least-squares line over
    the recent steps (exponentially weighted), anchored by a start-up prior
    that counts as `prior_weight` steps at 1 and at `prior_span` tokens."""

    def __init__(self, fixed_s: float, per_token_s: float, decay: float = 0.98,
                 prior_weight: float = 4.0, prior_span: int = 16) -> None:
        self.decay = decay
        self.sw = self.sn = self.snn = self.st = self.snt = 0.0
        for n in (1, prior_span):
            self._add(n, fixed_s + per_token_s * n, prior_weight)

    def _add(self, tokens: int, seconds: float, weight: float) -> None:
        self.sw += weight
        self.sn += weight * tokens
        self.snn += weight * tokens * tokens
        self.st += weight * seconds
        self.snt += weight * tokens * seconds

    def observe(self, tokens: int, seconds: float) -> None:
        for name in ("sw", "sn", "snn", "st", "snt"):
            setattr(self, name, getattr(self, name) * self.decay)
        self._add(tokens, seconds, 1.0)

    def line(self) -> tuple[float, float]:
        """(fixed_s, per_token_s), each at least a microsecond."""
        var = self.snn * self.sw - self.sn * self.sn
        per_token = (self.snt * self.sw - self.sn * self.st) / var if var > 0 else 0.0
        per_token = max(per_token, 1e-6)
        fixed = max((self.st - per_token * self.sn) / self.sw, 1e-6)
        return fixed, per_token


@dataclass(slots=True)
class DraftState:
    """A request's speculation: its prompt-lookup index and its acceptance."""

    lookup: PromptLookup
    accept_rate: float
    verify_ct: int = 0  # verify steps it took part in with drafts (SGLang's spec_verify_ct)
    drafted: int = 0
    accepted: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.verify_ct += 1
        self.drafted += drafted
        self.accepted += accepted
        # a rejected first draft says the rate is low; k accepted of k says high
        rate = accepted / drafted
        self.accept_rate += EMA_WEIGHT * (rate - self.accept_rate)


@dataclass
class SpecStats:
    """Server-wide counts (/metrics, /get_server_info)."""

    verify_steps: int = 0  # steps that verified at least one draft
    drafted: int = 0
    accepted: int = 0
    accept_lens: list[int] = field(default_factory=list)  # recent steps: tokens kept per speculating row

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Speculator:
    def __init__(self, args: ServerArgs, step_cost: tuple[float, float], context_len: int) -> None:
        self.max_drafts = args.speculative_num_draft_tokens - 1
        self.adaptive = not args.disable_speculative_adaptive
        self.min_window = args.speculative_ngram_min_match_window_size
        self.max_window = args.speculative_ngram_max_match_window_size
        self.context_len = context_len
        self.suffixes = SuffixTable(self.min_window, self.max_window, args.speculative_ngram_capacity) \
            if args.speculative_ngram_capacity else None
        self.cost = StepCost(*(step_cost if step_cost[0] > 0 else DEFAULT_STEP_COST))
        self.stats = SpecStats()
        self.server_rate = PRIOR_ACCEPT_RATE  # EMA over every verify: a new request's prior

    @staticmethod
    def can_verify(reqs: list[Req], has_penalties: bool) -> bool:
        """Penalties and a thinking budget advance a token at a time in state
        the model process (penalties) or the scheduler (a budget's forced
        token) cannot fork per draft: such a batch decodes plainly. (A grammar
        can: its masks are filled draft by draft, fill_draft_bitmasks.)"""
        return not has_penalties and all(r.thinking is None for r in reqs)

    def state(self, req: Req) -> DraftState:
        if req.draft_state is None:
            req.draft_state = DraftState(PromptLookup(self.min_window, self.max_window), self.server_rate)
        return req.draft_state

    def room(self, req: Req) -> int:
        """Drafts a row may take: never past max_new_tokens nor the context."""
        return min(self.max_drafts, req.sampling_params.max_new_tokens - len(req.output_ids) - 1,
                   self.context_len - req.num_tokens - 1)

    def may_pay(self, reqs: list[Req]) -> bool:
        """Whether drafts could pay in this batch at all, were every row to
        find all it may take: asked before the step in flight is waited for
        (a verify needs its tokens), so a batch too large to gain keeps the
        overlap schedule."""
        return not self.adaptive or any(self.keep(reqs, [max(0, self.room(r)) for r in reqs]))

    def propose(self, reqs: list[Req]) -> list[list[int]] | None:
        """Each row's drafts for this step (some may be empty), or None when
        no draft is expected to pay. Rows must have no token in flight."""
        drafts = []
        for r in reqs:
            room = self.room(r)
            found: list[int] = []
            if room > 0:
                found = self.state(r).lookup.propose(r.fill_ids, room)
                if not found and self.suffixes is not None:
                    found = self.suffixes.propose(r.fill_ids, room)
                if found and r.grammar is not None:  # cut where the grammar rejects a draft
                    found = found[:r.grammar.allowed_prefix(found)]
            drafts.append(found)
        return self.choose(reqs, drafts)

    def keep(self, reqs: list[Req], found: list[int]) -> list[int]:
        """How many of row i's found[i] drafts pay for their tokens: the j-th
        draft of a row adds accept_rate ** j tokens on average and one token's
        cost; drafts are kept best first while the step's expected tokens per
        second rise."""
        fixed, per_token = self.cost.line()
        gains = sorted(((self.state(r).accept_rate ** (j + 1), i)
                        for i, (r, n) in enumerate(zip(reqs, found)) for j in range(n)), reverse=True)
        tokens = float(len(reqs))  # expected tokens out of the step
        seconds = fixed + per_token * len(reqs)
        keep = [0] * len(reqs)
        for gain, i in gains:
            if (tokens + gain) * seconds <= tokens * (seconds + per_token):
                break
            tokens += gain
            seconds += per_token
            keep[i] += 1
        return keep

    def choose(self, reqs: list[Req], drafts: list[list[int]]) -> list[list[int]] | None:
        """The drafts cut to those that pay (keep), or None if none does. Not
        adaptive: every draft is kept."""
        if not self.adaptive:
            return drafts if any(drafts) else None
        keep = self.keep(reqs, [len(d) for d in drafts])
        for r, d, k in zip(reqs, drafts, keep):
            if d and not k:  # passed over: drift back towards the server's rate, to be tried again
                state = self.state(r)
                state.accept_rate += RETRY_DRIFT * max(0.0, self.server_rate - state.accept_rate)
        if not any(keep):
            return None
        return [d[:k] for d, k in zip(drafts, keep)]

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A decode or verify step's forward time, for the cost line."""
        if seconds > 0:
            self.cost.observe(tokens, seconds)

    def record(self, req: Req, drafted: int, accepted: int) -> None:
        """A row's verify result: `accepted` of its `drafted` drafts kept."""
        if drafted:
            self.state(req).record(drafted, accepted)
            self.server_rate += 0.05 * (accepted / drafted - self.server_rate)
            self.stats.drafted += drafted
            self.stats.accepted += accepted
            self.stats.accept_lens.append(accepted + 1)
            del self.stats.accept_lens[:-256]

    def finished(self, req: Req) -> None:
        """A request that ended: its output feeds the table of recent outputs."""
        if self.suffixes is not None and req.output_ids:
            self.suffixes.add(req.output_ids)
