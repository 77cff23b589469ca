"""A stand-in scheduler for testing the HTTP front end alone.

It binds `scheduler_input` and pushes to `tokenizer_input`, as the real one
does, and answers each request with a fixed token script in small chunks.
The rid picks the behaviour:
  "hang..."  sends one chunk, then waits for an AbortReq (or StopMatchedReq) and answers it;
  "slow..."  like the default, with longer pauses between chunks;
  otherwise  the script (cut to max_new_tokens) then EOS, in chunks of 3.
An abort is answered by a final abort row at the next chunk, unless the
request already finished (as the real scheduler does). With `silent` set, new
requests get no answer at all (a stuck engine); with `hold` set, every new
request behaves like a "hang..." one (for routes whose rids the server picks).

Logprobs, when asked for, are made up but checkable: token t has logprob
-t/1000, and its top-n list is (t, t+1, ...) with logprobs -(t+j)/1000;
token_ids_logprob's id j has -j/1000 at every position. Prompt
logprobs (logprob_start_len >= 0) follow the same rule, in the first message,
the first entry None (the real scheduler's layout).
"""

from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio

from common.messages import (AbortKind, AbortReq, BatchTokenOut, FinishAbort, FinishLength, FinishMatchedToken,
                             FinishReason, IpcPaths, SchedulerHeartbeat, SchedulerReply, StateQuery, StopMatchedReq,
                             TimelineQuery, FlushCacheQuery, ToSchedulerMsg, TokenizedGenerateReq)

HEARTBEAT_S = 0.5  # as the real scheduler's

FAKE_STATE = {"num_running_reqs": 1, "num_waiting_reqs": 2, "token_usage": 0.25,
              "total_retractions": 3, "new_token_ratio": 0.5, "batch_utilisation": 1.0,
              "cache_hit_rate": 0.5, "evictable_kv_slots": 7}


class FakeScheduler:
    def __init__(self, ipc: IpcPaths, script: list[int], eos: int, vocab_size: int = 1 << 30) -> None:
        self.script, self.eos, self.vocab_size = script, eos, vocab_size
        self.silent = False
        self.hold = False
        self.received: list[ToSchedulerMsg] = []
        self._aborted: dict[str, asyncio.Event] = {}
        self.ctx = zmq.asyncio.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(ipc.scheduler_input)
        self.push = self.ctx.socket(zmq.PUSH)
        # It connects before the app binds; retry fast, or the first rows wait
        # out ZMQ's default 100 ms reconnect interval and arrive all at once.
        self.push.setsockopt(zmq.RECONNECT_IVL, 5)
        self.push.connect(ipc.tokenizer_input)
        self._decoder = msgspec.msgpack.Decoder(ToSchedulerMsg)
        self._encoder = msgspec.msgpack.Encoder()
        self._tasks: set[asyncio.Task[None]] = set()
        self._prompt_lps_sent: set[str] = set()

    def aborts(self) -> list[str]:
        return [m.rid for m in self.received if isinstance(m, AbortReq)]

    def stops(self) -> list[str]:
        return [m.rid for m in self.received if isinstance(m, StopMatchedReq)]

    def requests(self) -> list[TokenizedGenerateReq]:
        return [m for m in self.received if isinstance(m, TokenizedGenerateReq)]

    async def run(self) -> None:
        beat = asyncio.create_task(self._heartbeat())
        try:
            await self._serve_messages()
        finally:
            beat.cancel()

    async def _heartbeat(self) -> None:
        """Like the real scheduler's, so the front end sees it alive (unless silent)."""
        while True:
            if not self.silent:
                await self.push.send(self._encoder.encode(SchedulerHeartbeat()))
            await asyncio.sleep(HEARTBEAT_S)

    async def _serve_messages(self) -> None:
        while True:
            msg = self._decoder.decode(await self.pull.recv())
            self.received.append(msg)
            if isinstance(msg, TokenizedGenerateReq):
                if self.silent:
                    continue
                self._aborted[msg.rid] = asyncio.Event()
                task = asyncio.create_task(self._serve(msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif isinstance(msg, (StateQuery, FlushCacheQuery, TimelineQuery)):
                if not self.silent:
                    await self.push.send(self._encoder.encode(self.answer(msg)))
            elif msg.rid in self._aborted:
                self._aborted[msg.rid].set()

    def answer(self, query: StateQuery | FlushCacheQuery | TimelineQuery) -> SchedulerReply:
        if isinstance(query, StateQuery):
            return SchedulerReply(query_id=query.query_id, ok=True, data=dict(FAKE_STATE))
        busy = bool(self._tasks)  # like the real one: no flush while requests run
        return SchedulerReply(query_id=query.query_id, ok=not busy,
                              message="busy" if busy else "Cache flushed.")

    async def _send(self, req: TokenizedGenerateReq, new: list[int], done: int,
                    reason: FinishReason | None) -> None:
        lps = [-t / 1000 for t in new] if req.return_logprob else []
        tops = ([[(-((t + j) % self.vocab_size) / 1000, (t + j) % self.vocab_size)
                  for j in range(req.top_logprobs_num)] for t in new] if req.return_logprob else [])
        # token_ids_logprob: id j has logprob -j/1000 at every position
        ids_lps = ([[-j / 1000 for j in req.token_ids_logprob] for _ in new]
                   if req.return_logprob and req.token_ids_logprob else [])
        in_lps: list = []
        in_tops: list = []
        if req.return_logprob and req.logprob_start_len >= 0 and req.rid not in self._prompt_lps_sent:
            self._prompt_lps_sent.add(req.rid)
            rest = req.input_ids[req.logprob_start_len + 1:]
            in_lps = [None] + [-t / 1000 for t in rest]
            if req.top_logprobs_num:
                in_tops = [None] + [[(-((t + j) % self.vocab_size) / 1000, (t + j) % self.vocab_size)
                                     for j in range(req.top_logprobs_num)] for t in rest]
        out = BatchTokenOut(
            rids=[req.rid], new_token_ids=[new], finished_reasons=[reason],
            prompt_tokens=[len(req.input_ids)], completion_tokens=[done],
            cached_tokens=[0], num_retractions=[0],
            output_token_logprobs=[lps], output_top_logprobs=[tops],
            input_token_logprobs=[in_lps], input_top_logprobs=[in_tops], output_token_ids_logprobs=[ids_lps])
        await self.push.send(self._encoder.encode(out))

    async def _serve(self, req: TokenizedGenerateReq) -> None:
        aborted = self._aborted[req.rid]
        n = req.sampling_params.max_new_tokens
        tokens = self.script[:n] if n <= len(self.script) else self.script + [self.eos]
        final = FinishLength(n) if n <= len(self.script) else FinishMatchedToken(self.eos)
        if req.rid.startswith("hang") or self.hold:
            await self._send(req, tokens[:3], 3, None)
            await aborted.wait()
            await self._send(req, [], 3, FinishAbort(AbortKind.CLIENT_GONE, "aborted by client"))
            return
        pause = 0.1 if req.rid.startswith("slow") else 0.01
        for start in range(0, len(tokens), 3):
            await asyncio.sleep(pause)
            if aborted.is_set():
                await self._send(req, [], start, FinishAbort(AbortKind.CLIENT_GONE, "aborted by client"))
                return
            chunk = tokens[start:start + 3]
            last = start + 3 >= len(tokens)
            await self._send(req, chunk, start + len(chunk), final if last else None)

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.pull.close(linger=0)
        self.push.close(linger=0)
        self.ctx.term()
