"""The scheduler's handle on the model: steps go out with `send`, results come
back, in the same order, with `recv`. Sending step t+1 before reading step t's
result is what lets the overlap schedule prepare a step while the model runs
the previous one."""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol

import zmq

from common.ipc import PullSocket, PushSocket
from common.messages import ForwardBatch, ForwardResult, IpcPaths


class ModelClient(Protocol):
    def send(self, batch: ForwardBatch) -> None: ...

    def recv(self) -> ForwardResult: ...


class LocalModel(Protocol):
    """An in-process model: a ModelRunner, or a test's fake."""

    def forward(self, batch: ForwardBatch) -> ForwardResult: ...


class ZmqModelClient:
    """The model process, over ZMQ: it runs the batches it receives one after
    another, so a second batch waits in the socket while the first runs.
    While a result is awaited, `on_wait` runs every `wait_poll_s` (the
    scheduler's heartbeat and watchdog: a model that never answers must not
    silence the scheduler too); whatever it raises ends the wait."""

    def __init__(self, ctx: zmq.Context, ipc: IpcPaths, wait_poll_s: float = 0.5) -> None:
        self.to_model = PushSocket(ctx, ipc.model_input)
        self.from_model: PullSocket[ForwardResult] = PullSocket(ctx, ipc.model_output, ForwardResult)
        self.wait_poll_ms = max(1, int(wait_poll_s * 1000))
        self.on_wait: Callable[[], None] = lambda: None

    def send(self, batch: ForwardBatch) -> None:
        self.to_model.send(batch)

    def recv(self) -> ForwardResult:
        while (result := self.from_model.recv(timeout_ms=self.wait_poll_ms)) is None:
            self.on_wait()
        return result


class InProcessModelClient:
    """A local model behind send/recv: each batch runs when it is sent (in
    order, as the model process would run them) and its result waits for recv."""

    def __init__(self, model: LocalModel) -> None:
        self.model = model
        self.results: deque[ForwardResult] = deque()

    def send(self, batch: ForwardBatch) -> None:
        self.results.append(self.model.forward(batch))

    def recv(self) -> ForwardResult:
        return self.results.popleft()


def as_model_client(model: ModelClient | LocalModel) -> ModelClient:
    if hasattr(model, "recv"):
        return model  # type: ignore[return-value]
    return InProcessModelClient(model)  # type: ignore[arg-type]
