"""The scheduler's handle on the model: steps go out with `send`, results come
back, in the same order, with `recv`. Sending step t+1 before reading step t's
result is what lets the overlap schedule prepare a step while the model runs
the previous one."""

from __future__ import annotations

from collections import deque
from typing import Protocol

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
    another, so a second batch waits in the socket while the first runs."""

    def __init__(self, ctx: zmq.Context, ipc: IpcPaths) -> None:
        self.to_model = PushSocket(ctx, ipc.model_input)
        self.from_model: PullSocket[ForwardResult] = PullSocket(ctx, ipc.model_output, ForwardResult)

    def send(self, batch: ForwardBatch) -> None:
        self.to_model.send(batch)

    def recv(self) -> ForwardResult:
        result = self.from_model.recv()
        assert result is not None  # recv without timeout blocks
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
