"""Tensor parallelism's rendezvous is not open to the network: torch's TCP
store would listen on every interface, with no password, so rank 0 hands it
a socket bound to the rendezvous host; every TCP socket rank 0 listens on
(the store's, gloo's) is on 127.0.0.1, the default rendezvous host."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from model_proc.parallel import init_tensor_parallel, split_host_port

LOOPBACK_V4 = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_addresses() -> list[str]:
    """This process's listening TCP sockets' local addresses (hex ip:port),
    from /proc/net/tcp and tcp6."""
    ours = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            ours.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and f"socket:[{fields[9]}]" in ours:  # state LISTEN
                    found.append(fields[1])
    return found


def _rank(rank: int, addr: str, out_dir: str) -> None:
    tp = init_tensor_parallel(rank, 2, addr, torch.device("cpu"))
    try:
        tp.all_reduce_(torch.ones(2))
        if rank == 0:
            torch.save(listening_addresses(), os.path.join(out_dir, "listening.pt"))
        tp.all_reduce_(torch.ones(2))  # rank 1 stays until rank 0 has looked
    finally:
        tp.close()


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp")
def test_rank0_listens_on_the_rendezvous_host_only(tmp_path: Path) -> None:
    mp.start_processes(_rank, args=(f"127.0.0.1:{free_port()}", str(tmp_path)), nprocs=2, start_method="spawn")
    listening = torch.load(tmp_path / "listening.pt")
    assert listening, "rank 0 listens on nothing?"
    assert all(addr.split(":")[0] == LOOPBACK_V4 for addr in listening), listening


def test_rendezvous_address_forms() -> None:
    assert split_host_port("127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert split_host_port("[::1]:29500") == ("::1", 29500)
    assert split_host_port("node0:29500") == ("node0", 29500)
