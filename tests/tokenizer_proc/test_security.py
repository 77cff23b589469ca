"""The API key and the request size limit."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.tokenizer_proc.samples import TEXT
from tests.tokenizer_proc.server_harness import Server, request
from tokenizer_proc.tokenizer import load_tokenizer

KEY = "sekret-key"
SMALL_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def locked(sp_model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(load_tokenizer(str(sp_model_file)), tmp_path_factory.mktemp("ipc"),
                 api_key=KEY, max_request_bytes=SMALL_LIMIT)
    yield srv
    srv.stop()


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


ROUTES = [("POST", "/generate"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("GET", "/v1/models"), ("GET", "/health_generate"), ("GET", "/get_model_info"),
          ("GET", "/get_server_info"), ("POST", "/abort_request")]


@pytest.mark.parametrize("method,path", ROUTES)
def test_key_required(locked: Server, method: str, path: str) -> None:
    n = len(locked.fake.received)
    for headers in ({}, auth("wrong"), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        status, ctype, raw = request(locked, method, path, {"text": "hi"}, headers)
        assert status == 401 and ctype == "application/json"
        err = json.loads(raw)["error"]
        assert err["code"] == 401 and err["type"] == "AuthenticationError"
    assert len(locked.fake.received) == n  # nothing reached the scheduler


def test_health_is_open(locked: Server) -> None:
    assert request(locked, "GET", "/health")[0] == 200


def test_right_key_works(locked: Server) -> None:
    status, _, raw = request(locked, "POST", "/generate", {"text": "hi"}, auth())
    assert status == 200 and json.loads(raw)["text"] == TEXT
    assert request(locked, "GET", "/health_generate", headers=auth())[0] == 200


def test_server_info_hides_the_key(locked: Server) -> None:
    status, _, raw = request(locked, "GET", "/get_server_info", headers=auth())
    assert status == 200 and KEY not in raw.decode() and json.loads(raw)["api_key"] == "<set>"


def test_openai_client_with_key(locked: Server) -> None:
    good = openai.OpenAI(base_url=locked.url + "/v1", api_key=KEY, max_retries=0, timeout=10)
    r = good.chat.completions.create(model="test", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content == TEXT
    bad = openai.OpenAI(base_url=locked.url + "/v1", api_key="wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good.close()
    bad.close()


def read_response(sock: socket.socket) -> bytes:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


def test_declared_big_body_refused_at_once(server: Server) -> None:
    """50 MB declared, a few bytes sent: the 413 comes without waiting for the rest."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    t0 = time.monotonic()
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 50000000\r\n\r\n{\"text\": ")
    head = read_response(sock)
    elapsed = time.monotonic() - t0
    sock.close()
    assert head.startswith(b"HTTP/1.1 413 ") and elapsed < 2


def test_chunked_big_body_refused_while_streaming(locked: Server) -> None:
    """No length declared: reading stops at the limit, long before the sender is done."""
    sock = socket.create_connection(("127.0.0.1", locked.port), timeout=5)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b"x" * 16384
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    sent, t0 = 0, time.monotonic()
    sock.setblocking(False)
    while sent < 50_000_000 and time.monotonic() - t0 < 5:
        if select.select([sock], [], [], 0)[0]:
            break  # the answer is there
        try:
            sent += sock.send(chunk)  # partial sends only corrupt what is refused anyway
        except BlockingIOError:
            select.select([sock], [sock], [], 0.05)
    sock.setblocking(True)
    head = read_response(sock)
    sock.close()
    assert head.startswith(b"HTTP/1.1 413 "), head[:200]
    assert sent < 50_000_000 and time.monotonic() - t0 < 5


def test_just_under_the_limit_is_read(locked: Server) -> None:
    body = json.dumps({"text": "hi", "pad": "x" * (SMALL_LIMIT - 100)}).encode()
    assert len(body) <= SMALL_LIMIT
    status, _, raw = request(locked, "POST", "/generate", body, auth())
    assert status == 400 and "pad" in json.loads(raw)["error"]["message"]  # read and parsed
    status, _, raw = request(locked, "POST", "/generate", body + b" " * 200, auth())
    assert status == 413 and json.loads(raw)["error"]["code"] == 413


def test_unauthenticated_big_body_gets_401(locked: Server) -> None:
    sock = socket.create_connection(("127.0.0.1", locked.port), timeout=5)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 50000000\r\n\r\n{")
    head = read_response(sock)
    sock.close()
    assert head.startswith(b"HTTP/1.1 401 ")


def test_expect_continue_refused_before_the_body(locked: Server) -> None:
    """curl-style `Expect: 100-continue`: the 413 comes instead of the invitation to send."""
    sock = socket.create_connection(("127.0.0.1", locked.port), timeout=5)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nExpect: 100-continue\r\nContent-Length: 50000000\r\n\r\n")
    head = read_response(sock)
    sock.close()
    assert head.startswith(b"HTTP/1.1 413 ")


def test_expect_continue_small_body_is_invited(locked: Server) -> None:
    body = json.dumps({"text": "hi"}).encode()
    sock = socket.create_connection(("127.0.0.1", locked.port), timeout=5)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
    assert read_response(sock).startswith(b"HTTP/1.1 100 Continue")
    sock.sendall(body)
    head = read_response(sock)
    sock.close()
    assert head.startswith(b"HTTP/1.1 200 ")
