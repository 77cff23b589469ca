"""One client cannot take the front end off the network: past
--max-connections a new connection gets a short 503 (and /health is still
answered on a few more), a request head that does not arrive within
--header-timeout-s closes its connection (slowloris), a body that does not
arrive within --body-timeout-s gets a 408, and the open-file limit is raised
to the hard limit. Fake scheduler behind the app; the flood beside streaming
clients on a real server is tests/reliability/test_slow_connections.py."""

from __future__ import annotations

import json
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tokenizer_proc.server_harness import Server, get, post
from tokenizer_proc.connections import HEALTH_RESERVE, raise_open_file_limit
from tokenizer_proc.tokenizer import load_tokenizer

LIMIT = 8
TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def small(sp_model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(load_tokenizer(str(sp_model_file)), tmp_path_factory.mktemp("ipc"), max_connections=LIMIT,
                 header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S)
    yield srv
    srv.stop()


def connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def ask(sock: socket.socket, head: bytes) -> tuple[int, bytes, bytes]:
    """Sends `head` (a whole request); (status, head, body) of the answer."""
    sock.sendall(head)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed with no answer: {data!r}"
        data += chunk
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head_bytes.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head_bytes.split(b" ")[1]), head_bytes, body


def generate_head(body: bytes = b'{"text": "hi"}') -> bytes:
    return (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def wait_closed(sock: socket.socket, limit_s: float) -> float:
    """Seconds until the server closes `sock` (reading whatever it sent)."""
    t0 = time.monotonic()
    sock.settimeout(limit_s)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, TimeoutError):
        pass
    return time.monotonic() - t0


def test_past_the_bound_503_and_health_still_answered(small: Server) -> None:
    idle = [connect(small) for _ in range(LIMIT)]
    try:
        time.sleep(0.05)  # all accepted
        status, head, body = ask(connect(small), generate_head())
        assert status == 503 and b"connection: close" in head.lower()
        err = json.loads(body)["error"]
        assert "--max-connections" in err["message"] and len(body) < 300
        assert ask(connect(small), HEALTH)[0] == 200
        # past the reserve too: a 503 at once, the connection closed
        extra = [connect(small) for _ in range(HEALTH_RESERVE)]
        time.sleep(0.05)
        status, _, body = ask(connect(small), HEALTH)
        assert status == 503 and b"--max-connections" in body
        for s in extra:
            s.close()
    finally:
        for s in idle:
            s.close()
    time.sleep(0.1)
    assert post(small, {"text": "hi"})[0] == 200  # room again


def test_slowloris_head_is_closed_within_the_timeout(small: Server) -> None:
    sock = connect(small)
    t0 = time.monotonic()
    request = b"GET /get_model_info HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100
    closed_after = None
    try:
        for byte in request:  # a header byte every 0.1 s: never a whole head
            sock.sendall(bytes([byte]))
            time.sleep(0.1)
            if time.monotonic() - t0 > 5 * TIMEOUT_S:
                break
    except (BrokenPipeError, ConnectionResetError):
        closed_after = time.monotonic() - t0
    if closed_after is None:
        closed_after = time.monotonic() - t0 + wait_closed(sock, 1.0)
    sock.close()
    assert closed_after < TIMEOUT_S + 1.0, closed_after
    assert get(small, "/get_model_info")[0] == 200


def test_idle_connection_closed_after_the_timeout(small: Server) -> None:
    sock = connect(small)
    assert ask(sock, HEALTH)[0] == 200  # kept alive, then idle
    assert wait_closed(sock, 5.0) < TIMEOUT_S + 1.0
    sock.close()


def test_slow_body_gets_408(small: Server) -> None:
    sock = connect(small)
    body = json.dumps({"text": "hi"}).encode()
    t0 = time.monotonic()
    status, head, raw = ask(sock, generate_head(body)[:-5])  # the head and most of the body; never the rest
    assert status == 408 and b"--body-timeout-s" in raw and b"connection: close" in head.lower()
    assert TIMEOUT_S - 0.1 < time.monotonic() - t0 < TIMEOUT_S + 1.0
    sock.close()
    assert not small.in_flight()


def test_open_file_limit_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
        assert raise_open_file_limit() == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]), hard))
