"""Tensor parallelism: the process group of the model ranks and the few
collectives the model needs (Megatron's split, as SGLang uses it).

A `TensorParallel` is handed to the model's layers; at size 1 every
collective is a no-op, so the single-process path runs no torch.distributed
code at all. Ranks talk through torch.distributed: gloo on a CPU, NCCL on
CUDA (plus a gloo group for the batches rank 0 broadcasts, which are bytes
on the host).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

# How long a collective may wait for the slowest rank. Loading the weights
# (and converting a GGUF file once) happens before the first one, so it must
# cover a slow start; an idle server never waits this long, since rank 0
# broadcasts a heartbeat while no batch arrives (model_proc/__main__.py).
GROUP_TIMEOUT = datetime.timedelta(minutes=10)


class TensorParallel:
    """This rank's place in the tensor-parallel group, and its collectives."""

    def __init__(self, rank: int = 0, size: int = 1, device: torch.device | None = None,
                 cpu_group: dist.ProcessGroup | None = None) -> None:
        self.rank, self.size = rank, size
        self.device = device or torch.device("cpu")
        # host-side group for broadcasting bytes (the default group, when it is gloo)
        self.cpu_group = cpu_group

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (a row-parallel matmul's partial products)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dim, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (the sampled tokens)."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (the others pass None): the length,
        then the bytes, over the host-side group."""
        if self.size == 1:
            assert data is not None
            return data
        length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.cpu_group)
        if self.is_first:
            assert data is not None
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        else:
            buf = torch.empty(int(length.item()), dtype=torch.uint8)
        if buf.numel():
            dist.broadcast(buf, src=0, group=self.cpu_group)
        return data if self.is_first and data is not None else buf.numpy().tobytes()

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (so that all ranks agree on a size)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


SINGLE = TensorParallel()


def init_tensor_parallel(rank: int, size: int, dist_init_addr: str, device: torch.device,
                         timeout: datetime.timedelta = GROUP_TIMEOUT) -> TensorParallel:
    """Join the group of `size` ranks at `dist_init_addr` (HOST:PORT, the
    TCP store that rank 0 serves). Returns SINGLE at size 1."""
    if size == 1:
        return SINGLE
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    host, port = split_host_port(dist_init_addr)
    if is_loopback(host):
        keep_collectives_on_loopback()
    # torch's own store listens on every interface, and it takes no password:
    # rank 0 hands it a socket bound to the rendezvous host alone.
    listen_fd = listen_socket(host, port).detach() if rank == 0 else None
    store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout, wait_for_workers=False,
                          master_listen_fd=listen_fd)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    # NCCL collectives take device tensors only: the batches (host bytes) go over gloo
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
    return TensorParallel(rank, size, device, cpu_group)


def split_host_port(addr: str) -> tuple[str, int]:
    """("::1", 5000) from "[::1]:5000"; ("node0", 5000) from "node0:5000"."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host` alone (not every interface)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(socket.SOMAXCONN)
    return sock


def keep_collectives_on_loopback() -> None:
    """A one-machine group: gloo's and NCCL's own connections on the loopback
    interface too (they would pick the interface of the machine's name),
    unless the user chose one."""
    if LOOPBACK_IFNAME not in (name for _, name in socket.if_nameindex()):
        return  # not Linux's name for it: leave the libraries' choice
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, LOOPBACK_IFNAME)


LOOPBACK_IFNAME = "lo"  # Linux's loopback interface


# ---- how the model is split ----------------------------------------------------------


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank computes: query heads
    [q_start, q_start + num_heads) and KV heads [kv_start, kv_start + num_kv_heads)."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def shard_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    """Query heads split evenly; KV heads split evenly too, or, with fewer KV
    heads than ranks, each rank holds a copy of the one KV head its query
    heads read (SGLang replicates them the same way)."""
    if num_heads % size:
        raise ValueError(f"--tp-size {size} does not divide the model's {num_heads} attention heads")
    if num_kv_heads >= size and num_kv_heads % size:
        raise ValueError(f"--tp-size {size} does not divide the model's {num_kv_heads} KV heads")
    if num_kv_heads < size and size % num_kv_heads:
        raise ValueError(f"--tp-size {size} is not a multiple of the model's {num_kv_heads} KV heads "
                         "(with fewer KV heads than ranks, each KV head is copied to size / kv_heads ranks)")
    local_q = num_heads // size
    if num_kv_heads >= size:
        local_kv = num_kv_heads // size
        kv_start = rank * local_kv
    else:
        local_kv = 1
        kv_start = rank // (size // num_kv_heads)
    return HeadShard(local_q, local_kv, rank * local_q, kv_start)


def shard_range(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """[start, end) of an evenly split dimension (the MLP's intermediate size)."""
    if total % size:
        raise ValueError(f"--tp-size {size} does not divide the model's {what} {total}")
    per = total // size
    return rank * per, (rank + 1) * per


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int, int]:
    """(start, end, rows per rank) of this rank's vocabulary slice: ceil(V / size)
    rows per rank, the last slice shorter (its missing rows are padding)."""
    per = -(-vocab_size // size)
    start = min(rank * per, vocab_size)
    return start, min(start + per, vocab_size), per
