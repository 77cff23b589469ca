"""The listening socket and its limits: how many connections one client (or
an attack) may hold, so that it cannot take the server off the network.

- The open-file limit is raised to its hard limit at start: every connection
  is a descriptor, and the usual soft limit (1,024) is what an idle-connection
  flood exhausts first.
- `ConnectionGate` is the protocol factory of the listening socket. Up to
  `limit` open connections are served as usual. The next `HEALTH_RESERVE` are
  accepted, but only `/health` is answered on them (anything else gets a 503
  and the connection is closed), so a load balancer still sees the process.
  Past that, a new connection is answered a 503 and closed at once.
- A request's headers must arrive within `--header-timeout-s` of the
  connection's start (or of the previous response on a kept-alive
  connection): aiohttp's keep-alive timer closes a connection still waiting
  for a whole request head when it fires. Its body must arrive within
  `--body-timeout-s` (`middlewares.read_body`). A slowloris client, which
  trickles bytes to keep a connection open, is closed by these.
"""

from __future__ import annotations

import asyncio
import logging
import resource

import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from tokenizer_proc.errors import error_body

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 4096
# descriptors kept for everything else the process opens (ZMQ sockets, files)
OTHER_DESCRIPTORS = 256
HEALTH_RESERVE = 32  # connections past the bound on which /health is still answered
REFUSED_LINGER_S = 1.0  # a refused connection waits this long for its request before closing
LISTEN_BACKLOG = 1024  # a burst of connects waits in the kernel, not in the client's SYN retries


def raise_open_file_limit() -> int:
    """Raises this process's soft RLIMIT_NOFILE to its hard limit; returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:  # some containers refuse; keep what we have
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft


def connection_limit(requested: int | None, open_files: int) -> int:
    """The connection bound: the flag's, or the default; never more than the
    descriptors leave room for (with the /health reserve)."""
    room = max(1, open_files - OTHER_DESCRIPTORS - HEALTH_RESERVE)
    limit = requested if requested is not None else DEFAULT_MAX_CONNECTIONS
    if limit > room:
        logger.warning("--max-connections %d is more than the open-file limit (%d) allows: %d",
                       limit, open_files, room)
        limit = room
    return limit


def _raw_503(message: str) -> bytes:
    body = msgspec.json.encode(error_body(message, 503, "ServiceUnavailableError"))
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return head + body


class _Refused(asyncio.Protocol):
    """A connection past the bound and the reserve: answered a 503 when its
    request starts (closing before reading it could reset the connection
    before the client reads the answer), closed after REFUSED_LINGER_S at most."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.transport: asyncio.WriteTransport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no asyncio.Transport)
        self.timer = asyncio.get_running_loop().call_later(REFUSED_LINGER_S, self._answer)

    def data_received(self, data: bytes) -> None:
        self._answer()

    def _answer(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.answer)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.transport = None


class ConnectionGate:
    """The listening socket's protocol factory (see the module's docstring).
    `server` is set once the runner has made it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.server: web.Server | None = None
        self._over: set[RequestHandler] = set()  # accepted past the bound: /health only
        self._refusal = _raw_503(self.over_bound_message())
        self.refused = 0

    def over_bound_message(self) -> str:
        return (f"the server holds its maximum of {self.limit} connections (--max-connections); "
                "retry later")

    def __call__(self) -> asyncio.BaseProtocol:
        assert self.server is not None, "the gate serves before the runner made its server"
        open_now = len(self.server.connections)
        if open_now >= self.limit + HEALTH_RESERVE:
            self.refused += 1
            return _Refused(self._refusal)
        handler = self.server()
        if open_now >= self.limit:
            if len(self._over) >= HEALTH_RESERVE:  # forget the closed ones (transport None)
                self._over = {h for h in self._over if h.transport is not None}
            self._over.add(handler)
        return handler

    def is_over_bound(self, protocol: object) -> bool:
        return protocol in self._over

    def release(self, protocol: object) -> None:
        self._over.discard(protocol)  # type: ignore[arg-type]


class GatedSite(web.BaseSite):
    """aiohttp's TCPSite with `ConnectionGate` as the protocol factory."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, gate: ConnectionGate) -> None:
        super().__init__(runner, backlog=LISTEN_BACKLOG)
        self._host, self._port, self._gate = host, port, gate

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        self._gate.server = self._runner.server
        self._server = await asyncio.get_running_loop().create_server(
            self._gate, self._host, self._port, backlog=self._backlog, reuse_address=True)
