"""Typed ZMQ push/pull sockets carrying msgspec-encoded messages (never pickle)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

T = TypeVar("T")

# High-water marks, in messages, set on every socket rather than left to ZMQ's
# default. What happens when one is reached is the sender's choice, one per
# link: the tokenizer process never blocks (a request it cannot hand over is a
# 503 at admission; an abort is retried until the scheduler has it), every
# other sender blocks until the peer reads (backpressure), so no message is
# ever dropped.
HWM_MESSAGES = 4096


class PushSocket:
    """Sends one message type over a PUSH socket."""

    def __init__(self, ctx: zmq.Context, addr: str, bind: bool = False, hwm: int = HWM_MESSAGES) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        (self.sock.bind if bind else self.sock.connect)(addr)
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, msg: Any, block: bool = True) -> None:
        """With block=False, raises zmq.Again instead of waiting when the
        queue to the peer is full (the peer is stuck or dead)."""
        self.sock.send(self._encoder.encode(msg), flags=0 if block else zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        self.sock.close()


class PullSocket(Generic[T]):
    """Receives messages of type `msg_type` (a Struct or a Union of tagged Structs)."""

    def __init__(self, ctx: zmq.Context, addr: str, msg_type: Any, bind: bool = True,
                 hwm: int = HWM_MESSAGES) -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        (self.sock.bind if bind else self.sock.connect)(addr)
        self._decoder = msgspec.msgpack.Decoder(msg_type)

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """Blocks up to `timeout_ms` (forever if None); None when nothing came."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return self._decoder.decode(self.sock.recv(copy=False).buffer)

    def recv_nowait(self) -> list[T]:
        """Everything already queued, without blocking."""
        msgs: list[T] = []
        while True:
            try:
                frame = self.sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return msgs
            msgs.append(self._decoder.decode(frame.buffer))

    def close(self) -> None:
        self.sock.close()


class AsyncPullSocket(Generic[T]):
    """PullSocket for asyncio code (the HTTP server)."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, msg_type: Any, bind: bool = True,
                 hwm: int = HWM_MESSAGES) -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        (self.sock.bind if bind else self.sock.connect)(addr)
        self._decoder = msgspec.msgpack.Decoder(msg_type)

    async def recv(self) -> T:
        frame = await self.sock.recv(copy=False)
        return self._decoder.decode(frame.buffer)

    def close(self) -> None:
        self.sock.close()
