"""The scheduler's handle on the model process: one ForwardBatch out, one ForwardResult back."""

from __future__ import annotations

import zmq

from common.ipc import PullSocket, PushSocket
from common.messages import ForwardBatch, ForwardResult, IpcPaths


class ZmqModelClient:
    def __init__(self, ctx: zmq.Context, ipc: IpcPaths) -> None:
        self.to_model = PushSocket(ctx, ipc.model_input)
        self.from_model: PullSocket[ForwardResult] = PullSocket(ctx, ipc.model_output, ForwardResult)

    def forward(self, batch: ForwardBatch) -> ForwardResult:
        self.to_model.send(batch)
        result = self.from_model.recv()
        assert result is not None
        return result
