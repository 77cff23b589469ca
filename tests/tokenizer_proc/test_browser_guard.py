"""A web page in the user's browser cannot drive a server started without
--api-key: a foreign Host (DNS rebinding), a request a browser marks as
cross-site (Origin, Sec-Fetch-Site) or a POST body declared as anything but
JSON is refused before any handler runs, and nothing is aborted; the names a
server answers to (localhost, its --host, any IP address, --allowed-hosts)
and ordinary clients are served. With --admin-api-key, the routes that act on
every client take that key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tokenizer_proc.server_harness import Server, open_raw, read_until, request, wait_until
from tokenizer_proc.tokenizer import load_tokenizer

ABORT_ALL = {"abort_all": True}
ADMIN = "admin-sekret"


def make(sp_model_file: Path, tmp_path_factory: pytest.TempPathFactory, **args: object) -> Iterator[Server]:
    srv = Server(load_tokenizer(str(sp_model_file)), tmp_path_factory.mktemp("ipc"), **args)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def named(sp_model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from make(sp_model_file, tmp_path_factory, allowed_hosts="api.example.com, Other.example")


@pytest.fixture(scope="module")
def admin(sp_model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from make(sp_model_file, tmp_path_factory, admin_api_key=ADMIN)


def error(raw: bytes) -> str:
    return json.loads(raw)["error"]["message"]


@pytest.fixture
def held(server: Server) -> Iterator[str]:
    """A request in flight (it hangs until aborted): what abort_all would end."""
    sock = open_raw(server, {"text": "hi", "stream": True, "rid": "hang-guard"})
    read_until(sock, b"data: ")
    yield "hang-guard"
    sock.close()
    wait_until(lambda: "hang-guard" not in server.in_flight())


@pytest.mark.parametrize("headers,what", [
    ({"Host": "evil.example:30000"}, "Host header"),  # a page's own name, rebound to 127.0.0.1
    ({"Origin": "http://evil.example"}, "evil.example"),
    ({"Origin": "null"}, "null"),  # a sandboxed frame or a file: page
    ({"Sec-Fetch-Site": "cross-site"}, "another site"),
    ({"Content-Type": "text/plain"}, "text/plain"),  # fetch(..., {mode: "no-cors", body: "..."})
    ({"Content-Type": "application/x-www-form-urlencoded"}, "x-www-form-urlencoded"),  # a <form>
])
def test_what_a_page_could_send_aborts_nothing(server: Server, held: str, headers: dict[str, str],
                                                what: str) -> None:
    aborts = len(server.fake.aborts())
    status, _, raw = request(server, "POST", "/abort_request", ABORT_ALL, headers)
    assert status in (400, 403) and what in error(raw), (status, raw)
    assert held in server.in_flight() and len(server.fake.aborts()) == aborts


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", "LOCALHOST", "app.localhost", "10.1.2.3"])
def test_local_names_and_addresses_are_served(server: Server, host: str) -> None:
    status, _, _ = request(server, "GET", "/get_model_info", headers={"Host": f"{host}:{server.port}"})
    assert status == 200


def test_foreign_host_refused_on_every_route_but_health(server: Server) -> None:
    evil = {"Host": "evil.example"}
    for method, path in (("GET", "/get_model_info"), ("GET", "/v1/models"), ("GET", "/flush_cache"),
                         ("GET", "/timeline"), ("POST", "/generate"), ("POST", "/v1/chat/completions")):
        status, _, raw = request(server, method, path, {"text": "hi"} if method == "POST" else None, evil)
        assert status == 403 and "--allowed-hosts" in error(raw), (path, raw)
    assert request(server, "GET", "/health", headers=evil)[0] == 200  # a probe: holds no data


def test_same_origin_and_scripts_are_served(server: Server) -> None:
    origin = {"Origin": f"http://127.0.0.1:{server.port}", "Sec-Fetch-Site": "same-origin"}
    status, _, raw = request(server, "POST", "/generate", {"text": "hi"}, origin)  # the dashboard's own page
    assert status == 200, raw
    # a script that declares no type (requests' data=, http.client) and charset parameters are taken
    for ctype in (None, "application/json; charset=utf-8", "Application/JSON"):
        headers = {} if ctype is None else {"Content-Type": ctype}
        status, _, raw = request(server, "POST", "/generate", json.dumps({"text": "hi"}).encode(), headers)
        assert status == 200, (ctype, raw)
    # an empty POST (urllib's data=b"" declares a form) has no body to misread
    status, _, raw = request(server, "POST", "/flush_cache", b"",
                             {"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 200 or "Content-Type" not in error(raw), raw  # (a busy fake scheduler refuses a flush)


def test_allowed_hosts_add_names(named: Server) -> None:
    for host in ("api.example.com", "other.example:8000", "localhost"):
        assert request(named, "GET", "/v1/models", headers={"Host": host})[0] == 200, host
    assert request(named, "GET", "/v1/models", headers={"Host": "evil.example"})[0] == 403
    assert request(named, "GET", "/v1/models", headers={"Origin": "https://api.example.com"})[0] == 200


def test_any_host_opt_out(sp_model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    for srv in make(sp_model_file, tmp_path_factory, allowed_hosts="*"):
        for headers in ({"Host": "evil.example"}, {"Origin": "http://evil.example"},
                        {"Sec-Fetch-Site": "cross-site"}):
            assert request(srv, "GET", "/v1/models", headers=headers)[0] == 200, headers
        # the body's declared type is still checked: JSON is what the routes read
        assert request(srv, "POST", "/generate", b"{}", {"Content-Type": "text/plain"})[0] == 400


def test_api_key_replaces_the_browser_checks(sp_model_file: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A page cannot attach the key (a custom Authorization header needs the
    server's consent), so with a key a proxy's names need no flag."""
    for srv in make(sp_model_file, tmp_path_factory, api_key="k"):
        status, _, _ = request(srv, "GET", "/v1/models", headers={"Host": "proxy.internal", "Authorization": "Bearer k"})
        assert status == 200


def test_admin_routes_need_the_admin_key(admin: Server) -> None:
    key = {"Authorization": f"Bearer {ADMIN}"}
    for method, path, body in (("POST", "/abort_request", ABORT_ALL), ("GET", "/flush_cache", None),
                               ("POST", "/flush_cache", None), ("GET", "/timeline", None)):
        for wrong in ({}, {"Authorization": "Bearer nope"}):
            status, _, raw = request(admin, method, path, body, wrong)
            assert status == 403 and "--admin-api-key" in error(raw), (path, raw)
        assert request(admin, method, path, body, key)[0] == 200, path
    # what acts on one's own requests needs no admin key
    assert request(admin, "POST", "/abort_request", {"rid": "some-rid"})[0] == 200
    assert request(admin, "POST", "/generate", {"text": "hi"})[0] == 200
    status, _, raw = request(admin, "GET", "/get_server_info")
    assert status == 200 and ADMIN not in raw.decode() and json.loads(raw)["admin_api_key"] == "<set>"
