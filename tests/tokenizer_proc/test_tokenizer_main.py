"""`python -m tokenizer_proc` as launch.py runs it: ready message once the
port listens, /health answers, SIGTERM ends it cleanly and promptly once
--shutdown-timeout has run out, and a request still in flight then gets a
final abort answer rather than a hang."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from common.ipc import PullSocket
from common.messages import IpcPaths, ModelInfo, ReadyMsg, ToSchedulerMsg, TokenizedGenerateReq
from common.proc import ChildConfig, child_env
from common.server_args import ServerArgs
from tokenizer_proc.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_process_ready_health_sigterm(sp_folder: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(str(sp_folder))
    ipc = IpcPaths.in_dir(str(tmp_path))
    port = free_port()
    info = ModelInfo(
        model_path="", tokenizer_path=str(sp_folder), served_model_name="test", context_len=256,
        max_total_tokens=1024, vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids,
        dtype="float32", device="cpu", kv_cache_bytes=0)
    cfg = ChildConfig(server_args=ServerArgs(model_path="unused", port=port, log_level="warning",
                                                 shutdown_timeout=0.5),
                      ipc=ipc, model_info=info)
    ctx = zmq.Context()
    launcher: PullSocket[ReadyMsg] = PullSocket(ctx, ipc.launcher, ReadyMsg, bind=True)
    scheduler: PullSocket[ToSchedulerMsg] = PullSocket(ctx, ipc.scheduler_input, ToSchedulerMsg, bind=True)
    proc = subprocess.Popen([sys.executable, "-m", "tokenizer_proc"], env=child_env(cfg),
                            cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        ready = launcher.recv(timeout_ms=20_000)
        assert ready is not None, "no ready message"
        assert ready.proc == "tokenizer" and ready.pid == proc.pid
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)  # listening already
        conn.request("GET", "/health")
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read()) == {}
        conn.close()

        # A streaming request the (absent) scheduler never answers.
        answer: list[bytes] = []

        def stream_request() -> None:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("POST", "/generate", body=json.dumps({"text": "hi", "stream": True}))
            answer.append(c.getresponse().read())
            c.close()

        client = threading.Thread(target=stream_request)
        client.start()
        assert isinstance(scheduler.recv(timeout_ms=5000), TokenizedGenerateReq)

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() - t0 < 2.0
        client.join(timeout=5)
        events = answer[0].split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""]
        final = json.loads(events[-3][len(b"data: "):])
        reason = final["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "--shutdown-timeout" in reason["message"], reason
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()
        launcher.close()
        scheduler.close()
        ctx.term()
