"""When a decode step verifies drafts, and how many per row.

A step on a CPU costs about a fixed part (the weights streamed once, the
per-step overheads) plus a part per token, and a verify step (several
tokens per row, every one through the LM head, the quantized products' tile
path) has a line of its own beside the decode step's. Per step the
Speculator takes each row's drafts (ngram.py), ranks every draft token by
its expected gain (a row's j-th draft is kept with probability rate ** j,
the row's per-draft acceptance), and verifies the best m of them for the m
that gives the most expected tokens per second, if that beats the plain
decode step's rate. A large batch therefore stops speculating by itself:
its fixed part is shared by many rows already, so drafts add time without
adding much rate.

Both cost lines start from the model process's start-up measurement
(ModelInfo.step_cost) and follow the measured forward times of the steps of
their kind (CostLine). Acceptance is counted as the geometric model has it
(Acceptance): a verify that keeps a of k drafts saw a successes and, when
a < k, one failure. A row's rate is its own counts plus a prior of the
server-wide rate; a new server's prior is optimistic, so the first rows
verify and teach it, and a row passed over fades back towards the prior,
so its drafts are tried again later (its text may have turned to a quote).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.server_args import ServerArgs
from scheduler_proc.req import Req
from scheduler_proc.speculative.ngram import PromptLookup, SuffixTable

# a new server's per-draft acceptance before any verify: optimistic, so that
# rows verify and measure it (a wrong guess costs a step's few drafts)
PRIOR_ACCEPT_RATE = 0.8
ROW_PRIOR_WEIGHT = 2.0  # drafts' worth of the server-wide rate in a row's rate
ROW_DECAY = 0.8  # a row's counts fade per verify, and per step it is passed over
SERVER_DECAY = 0.99  # the server-wide counts fade per verified row
# the cost line when the model did not measure one (an in-process test model):
# a 2-core CPU's small model, 20 ms a step plus 1 ms a token
DEFAULT_STEP_COST = (0.02, 0.001)


class CostLine:
    """seconds(step) ~ fixed + per_token * tokens: a least-squares line over
    the steps seen (exponentially faded), plus two prior points (1 and
    `prior_span` tokens, `prior_weight` steps each) that never fade, so the
    line stays put while the steps seen all have the same size."""

    def __init__(self, fixed_s: float, per_token_s: float, decay: float = 0.99,
                 prior_weight: float = 1.0, prior_span: int = 16) -> None:
        self.decay = decay
        self.prior = [(n, fixed_s + per_token_s * n, prior_weight) for n in (1, prior_span)]
        self.seen = [0.0] * 5  # faded sums of weight, n, n^2, t, n*t

    def observe(self, tokens: int, seconds: float) -> None:
        self.seen = [x * self.decay for x in self.seen]
        for k, v in enumerate((1.0, tokens, tokens * tokens, seconds, tokens * seconds)):
            self.seen[k] += v

    def line(self) -> tuple[float, float]:
        """(fixed_s, per_token_s), each at least a microsecond."""
        sw, sn, snn, st, snt = self.seen
        for n, t, w in self.prior:
            sw, sn, snn, st, snt = sw + w, sn + w * n, snn + w * n * n, st + w * t, snt + w * n * t
        var = snn * sw - sn * sn
        per_token = max((snt * sw - sn * st) / var if var > 0 else 0.0, 1e-6)
        return max((st - per_token * sn) / sw, 1e-6), per_token

    def seconds(self, tokens: int) -> float:
        fixed, per_token = self.line()
        return fixed + per_token * tokens


@dataclass(slots=True)
class Acceptance:
    """Faded counts of drafts kept (successes) out of drafts decided (trials)."""

    successes: float = 0.0
    trials: float = 0.0

    def add(self, drafted: int, accepted: int, decay: float) -> None:
        # the drafts after the first rejected one were never decided
        self.successes = self.successes * decay + accepted
        self.trials = self.trials * decay + accepted + (accepted < drafted)

    def fade(self, decay: float) -> None:
        self.successes *= decay
        self.trials *= decay

    def rate(self, prior: float, weight: float) -> float:
        return (self.successes + prior * weight) / (self.trials + weight)


@dataclass(slots=True)
class DraftState:
    """A request's speculation: its prompt-lookup index and its acceptance."""

    lookup: PromptLookup
    acceptance: Acceptance = field(default_factory=Acceptance)
    verify_ct: int = 0  # verify steps it took part in with drafts (SGLang's spec_verify_ct)
    drafted: int = 0
    accepted: int = 0


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
        prior = step_cost if step_cost[0] > 0 else DEFAULT_STEP_COST
        self.decode_cost = CostLine(*prior)  # by rows
        self.verify_cost = CostLine(*prior)  # by tokens
        self.stats = SpecStats()
        self.server = Acceptance()  # every verified row's counts: a new row's prior

    def rate(self, req: Req) -> float:
        """The row's per-draft acceptance: its counts over the server's."""
        server = self.server.rate(PRIOR_ACCEPT_RATE, ROW_PRIOR_WEIGHT)
        return self.state(req).acceptance.rate(server, ROW_PRIOR_WEIGHT)

    def state(self, req: Req) -> DraftState:
        if req.draft_state is None:
            req.draft_state = DraftState(PromptLookup(self.min_window, self.max_window))
        return req.draft_state

    def room(self, req: Req) -> int:
        """Drafts a row may take: never past max_new_tokens nor the context,
        nor its thinking budget's end (ThinkingBudget.draft_room); none for a
        penalized row, whose penalty state advances a token a step in the
        model process (it runs its one token beside the drafting rows)."""
        if req.penalized:
            return 0
        room = min(self.max_drafts, req.sampling_params.max_new_tokens - len(req.output_ids) - 1,
                   self.context_len - req.num_tokens - 1)
        cap = req.thinking.draft_room() if req.thinking is not None else None
        return max(0, room if cap is None else min(room, cap))

    def may_pay(self, reqs: list[Req]) -> bool:
        """Whether drafts could pay in this batch at all, were every row to
        find all it may take: asked before the step in flight is waited for
        (a verify needs its tokens), so a batch too large to gain keeps the
        overlap schedule."""
        return not self.adaptive or any(self.keep(reqs, [self.room(r) for r in reqs]))

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
        """How many of row i's found[i] drafts to verify: the draft tokens
        ranked by expected gain, the best m of them for the m with the most
        expected tokens per second; none if no m beats the decode step."""
        rates = [self.rate(r) for r in reqs]
        gains = sorted(((rate ** (j + 1), i) for i, (rate, n) in enumerate(zip(rates, found)) for j in range(n)),
                       reverse=True)
        rows = len(reqs)
        best_m, best = 0, rows / self.decode_cost.seconds(rows)
        tokens = float(rows)  # expected tokens out of the step
        for m, (gain, _) in enumerate(gains, 1):
            tokens += gain
            value = tokens / self.verify_seconds(rows + m)
            if value > best:
                best_m, best = m, value
        keep = [0] * rows
        for _, i in gains[:best_m]:
            keep[i] += 1
        return keep

    def choose(self, reqs: list[Req], drafts: list[list[int]]) -> list[list[int]] | None:
        """The drafts cut to those that pay (keep), or None if none does. Not
        adaptive: every draft is kept."""
        if not self.adaptive:
            return drafts if any(drafts) else None
        keep = self.keep(reqs, [len(d) for d in drafts])
        for r, d, k in zip(reqs, drafts, keep):
            if d and not k:  # passed over: fade towards the server's rate, to be tried again
                self.state(r).acceptance.fade(ROW_DECAY)
        if not any(keep):
            return None
        return [d[:k] for d, k in zip(drafts, keep)]

    def verify_seconds(self, tokens: int) -> float:
        """A verify step of `tokens` tokens: its line, but never less than a
        decode step of as many rows, which does no more work (the same
        matmuls on as many rows, attention over no more KV). The verify line
        learns only from verify steps, which a large batch rarely takes, while
        its start-up prior comes from probes of up to 16 tokens: on quantized
        weights those run the native decoder, and extrapolated to 32 tokens
        it priced a verify below the decode step the server measured (32 rows:
        107 against 140 ms), so every 32-row step waited for its predecessor
        to look for drafts, and the overlap was lost."""
        return max(self.verify_cost.seconds(tokens), self.decode_cost.seconds(tokens))

    def observe_step(self, verify: bool, rows: int, tokens: int, seconds: float) -> None:
        """A decode step's (by rows) or a verify step's (by tokens) forward time."""
        if seconds > 0:
            if verify:
                self.verify_cost.observe(tokens, seconds)
            else:
                self.decode_cost.observe(rows, seconds)

    def record(self, req: Req, drafted: int, accepted: int) -> None:
        """A row's verify result: `accepted` of its `drafted` drafts kept."""
        if drafted:
            state = self.state(req)
            state.verify_ct += 1
            state.drafted += drafted
            state.accepted += accepted
            state.acceptance.add(drafted, accepted, ROW_DECAY)
            self.server.add(drafted, accepted, SERVER_DECAY)
            self.stats.drafted += drafted
            self.stats.accepted += accepted
            self.stats.accept_lens.append(accepted + 1)
            del self.stats.accept_lens[:-256]

    def finished(self, req: Req) -> None:
        """A request that ended: its output feeds the table of recent outputs."""
        if self.suffixes is not None and req.output_ids:
            self.suffixes.add(req.output_ids)
