"""One rank per host in a torch.distributed process group (docs/multi-node.md).

Inside a host nothing changes: threads and in-process NCCL. Across hosts, torchrun (our
`trainer.distributed.launch`) starts one rank per host and this module holds what the ranks share:

* the gradient group: NCCL when the drafters are on GPUs, gloo on CPU; one all-reduce per step
  of one replica's flat gradient buffer (its STAT slots included, so the loss is normalised over
  the whole global step exactly as on one host);
* a gloo group for small CPU-side agreements (stop/checkpoint at a step boundary, resume);
* a watchdog over the rendezvous store: every rank bumps a heartbeat counter; a rank that fails
  writes its reason; a peer whose counter stops moving for `peer_timeout_s`, a peer that reports
  a failure, or a store that no longer answers means every other host stops promptly (no hang
  until an NCCL/gloo timeout of minutes), each with the reason in its status.json.

Counters rather than timestamps: the hosts' clocks need not agree.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

WATCH_INTERVAL_S = 0.5


class PeerLost(RuntimeError):
    """Another host of the run failed or stopped answering; this one stops too."""


@dataclass(frozen=True)
class GroupEnv:
    """What torchrun tells a rank (its environment)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    run_id: str
    restart: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "GroupEnv | None":
        """None outside torchrun (a plain `python -m trainer` run)."""
        env = os.environ if environ is None else environ
        if "TORCHELASTIC_RUN_ID" not in env or "WORLD_SIZE" not in env:
            return None
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                   env["TORCHELASTIC_RUN_ID"], int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))


def choose_backend(wanted: str, drafter_devices: list[str]) -> str:
    if wanted != "auto":
        return wanted
    return "nccl" if all(d.startswith("cuda") for d in drafter_devices) else "gloo"


class HostGroup:
    """The process group of one run's hosts plus its watchdog. `start()` joins, `close()` leaves."""

    def __init__(self, env: GroupEnv, backend: str, timeout_s: float, peer_timeout_s: float,
                 socket_ifname: str | None = None):
        self.env = env
        self.rank, self.world = env.rank, env.world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.peer_timeout_s = peer_timeout_s
        self.socket_ifname = socket_ifname
        self.node = socket.gethostname()
        self.control: Any = None  # the gloo group for agreements (the default group when it is gloo)
        self.store: Any = None  # a PrefixStore over the rendezvous' TCPStore, once started
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # ------------------------------------------------------------------ joining
    def start(self) -> None:
        timeout = timedelta(seconds=self.timeout_s)
        if self.socket_ifname:  # read by gloo and NCCL when the group is made
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = self.socket_ifname
        dist.init_process_group(self.backend, timeout=timeout)
        self.control = dist.group.WORLD if self.backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        client = dist.TCPStore(self.env.master_addr, self.env.master_port, is_master=False,
                               timeout=timedelta(seconds=max(1.0, self.peer_timeout_s / 2)))
        self.store = dist.PrefixStore(f"dflash/{self.env.run_id}/{self.env.restart}/", client)
        self.store.set(f"node/{self.rank}", json.dumps({"node": self.node, "pid": os.getpid()}))
        self.store.add(f"hb/{self.rank}", 1)

    def describe(self) -> dict:
        """status.json's `distributed` field."""
        return {"rank": self.rank, "world_size": self.world, "backend": self.backend, "node": self.node,
                "rendezvous": f"{self.env.master_addr}:{self.env.master_port}",
                "socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}

    # ------------------------------------------------------------------ collectives
    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the hosts in place (the gradient group). A failure names the lost peer."""
        try:
            dist.all_reduce(tensor)
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses of many kinds
            raise PeerLost(self.explain(f"the all-reduce across hosts failed ({type(exc).__name__}: {exc})")) from exc

    def agree(self, values: list[int]) -> list[int]:
        """Element-wise max over the hosts of small non-negative ints (the control group)."""
        t = torch.tensor(values, dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        except Exception as exc:  # noqa: BLE001
            raise PeerLost(self.explain(f"agreeing with the other hosts failed ({type(exc).__name__}: {exc})")) from exc
        return [int(v) for v in t]

    def all_gather_object(self, obj: object) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def broadcast_object(self, obj: object, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.control)
        return box[0]

    # ------------------------------------------------------------------ failure reports
    def peer_name(self, rank: int) -> str:
        try:
            if self.store is not None and self.store.check([f"node/{rank}"]):
                return f"rank {rank} on {json.loads(self.store.get(f'node/{rank}'))['node']}"
        except Exception:  # noqa: BLE001 - naming the peer is best effort
            pass
        return f"rank {rank}"

    def failures(self) -> list[str]:
        """Reasons the other ranks reported (empty when none)."""
        if self.store is None or self.store.add("failures", 0) == 0:
            return []
        found = []
        for r in range(self.world):
            if r != self.rank and self.store.check([f"failed/{r}"]):
                found.append(f"{self.peer_name(r)} failed: {self.store.get(f'failed/{r}').decode()}")
        return found

    def explain(self, what: str) -> str:
        """`what`, plus the peer failure that explains it when one was reported (waits briefly for it)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                reported = self.failures()
            except Exception:  # noqa: BLE001 - the store may be gone with its host
                break
            if reported:
                return f"{'; '.join(reported)} ({what})"
            time.sleep(0.1)
        return f"{what}; a peer host is gone"

    def report_failure(self, message: str) -> None:
        """Tell the other ranks why this one fails (best effort: the store may be gone)."""
        try:
            self.store.set(f"failed/{self.rank}", message[:2000])
            self.store.add("failures", 1)
        except Exception:  # noqa: BLE001
            pass

    def report_finished(self) -> None:
        """This rank ends normally: its heartbeat stopping is not a failure."""
        try:
            self.store.set(f"finished/{self.rank}", "1")
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ the watchdog
    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Start the heartbeat/watchdog thread; `on_lost(message)` is called once, from it."""
        self._watcher = threading.Thread(target=self._watch, args=(on_lost,), name="host-watchdog", daemon=True)
        self._watcher.start()

    def _watch(self, on_lost: Callable[[str], None]) -> None:
        peers = [r for r in range(self.world) if r != self.rank]
        seen = {r: (-1, time.monotonic()) for r in peers}
        store_ok = time.monotonic()
        while not self._watch_stop.wait(WATCH_INTERVAL_S):
            now = time.monotonic()
            try:
                self.store.add(f"hb/{self.rank}", 1)
                reported = self.failures()
                if reported:
                    on_lost("; ".join(reported))
                    return
                for r in peers:
                    if self.store.check([f"finished/{r}"]):
                        seen[r] = (-2, now)
                        continue
                    count = self.store.add(f"hb/{r}", 0)
                    if count != seen[r][0]:
                        seen[r] = (count, now)
                    elif seen[r][0] != -2 and now - seen[r][1] > self.peer_timeout_s:
                        on_lost(f"{self.peer_name(r)} stopped answering: no heartbeat for {now - seen[r][1]:.0f} s")
                        return
                store_ok = now
            except Exception as exc:  # noqa: BLE001 - DistStoreError, ConnectionError, timeouts
                if now - store_ok > self.peer_timeout_s:
                    on_lost(f"the rendezvous store {self.env.master_addr}:{self.env.master_port} stopped answering "
                            f"for {now - store_ok:.0f} s (its host is gone?): {type(exc).__name__}: {exc}")
                    return

    def close(self) -> None:
        self._watch_stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2 * WATCH_INTERVAL_S + 1)
