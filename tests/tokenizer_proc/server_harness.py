"""The HTTP front end alone: the real app on a real port, a fake scheduler
behind it (both on one uvloop in a background thread), and small HTTP helpers
for the tests that drive it."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvloop

from common.messages import IpcPaths, ModelInfo
from common.server_args import ServerArgs
from tests.tokenizer_proc.fake_scheduler import FakeScheduler
from tests.tokenizer_proc.samples import TEXT
from tokenizer_proc.http_server import MANAGER, build_app, start_http
from tokenizer_proc.tokenizer import Tokenizer

CONTEXT_LEN = 256


class Server:
    def __init__(self, tokenizer: Tokenizer, ipc_dir: Path, health_generate_timeout: float = 20.0,
                 context_len: int = CONTEXT_LEN, **server_args: Any) -> None:
        self.tokenizer = tokenizer
        self.ipc = IpcPaths.in_dir(str(ipc_dir))
        self.eos = tokenizer.eos_token_ids[0]
        self.script = tokenizer.encode(TEXT)[1:]  # what the "model" generates (no BOS)
        self.info = ModelInfo(
            model_path="", tokenizer_path="", served_model_name="test", context_len=context_len,
            max_total_tokens=4096, vocab_size=tokenizer.vocab_size, eos_token_ids=[self.eos],
            dtype="float32", device="cpu", kv_cache_bytes=0)
        self.args = ServerArgs(model_path="unused", **server_args)
        self.health_generate_timeout = health_generate_timeout
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self._start())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    async def _start(self) -> None:
        self.fake = FakeScheduler(self.ipc, self.script, self.eos, vocab_size=self.tokenizer.vocab_size)
        self.fake_task = asyncio.create_task(self.fake.run())
        self.app = build_app(self.args, self.info, self.ipc, self.tokenizer,
                             health_generate_timeout=self.health_generate_timeout)
        self.runner = await start_http(self.app, "127.0.0.1", 0)
        self.port: int = self.runner.addresses[0][1]

    async def _stop(self) -> None:
        await self.runner.cleanup()
        self.fake_task.cancel()
        self.fake.close()

    def stop(self) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)

    def in_flight(self) -> set[str]:
        return set(self.app[MANAGER].states)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def request(server: Server, method: str, path: str, body: Any = None,
            headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, resp.getheader("Content-Type", ""), resp.read()
    conn.close()
    return out


def post(server: Server, body: Any, path: str = "/generate") -> tuple[int, str, bytes]:
    return request(server, "POST", path, body)


def get(server: Server, path: str, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    return request(server, "GET", path, headers=headers)


def sse_events(body: bytes) -> list[Any]:
    assert body.endswith(b"data: [DONE]\n\n")
    chunks = body.split(b"\n\n")
    assert chunks[-1] == b"" and all(c.startswith(b"data: ") for c in chunks[:-1])
    return [json.loads(c[len(b"data: "):]) for c in chunks[:-2]]


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def open_raw(server: Server, body: dict[str, Any], path: str = "/generate") -> socket.socket:
    """Sends a request on a bare socket, so the test can hang up mid-way."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (path.encode(), len(data)) + data)
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    buf = b""
    while marker not in buf:
        chunk = sock.recv(4096)
        assert chunk, "connection closed early"
        buf += chunk
    return buf
