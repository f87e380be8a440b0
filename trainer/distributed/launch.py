"""python -m trainer launch: one host's part of a run across hosts, through torchrun.

    python -m trainer launch --nnodes 2 --rdzv-endpoint 10.0.0.1:29400 --rdzv-id RUN \\
        [--store-host] [--local-addr 10.0.0.2] --config C --run-dir D [--resume latest]

Runs torch.distributed.run (torchrun) in this process with the c10d rendezvous, one rank on
this host (`python -m trainer --config C --run-dir D`), no restarts. This process is torchrun's
agent: it stays while the rank runs, so when the rank dies without a word (SIGKILL, OOM killer)
it writes why into the rank's status.json. `--store-host` marks the host that serves the
rendezvous store at the endpoint (the host whose address it is). `--local-addr` is this host's
address the others reach; the interface holding it becomes GLOO_SOCKET_IFNAME and
NCCL_SOCKET_IFNAME unless those are set already.

The store at the endpoint carries a generation (a fresh token per store-host launcher, key
GENERATION_KEY): a host that is not the store host joins only a store whose generation differs
from the one it joined last (RUNDIR/REJOIN_FILE). When a supervisor restarts the group after a
crash (`runs.py supervise`, docs/multi-node.md), every host's launcher starts again at the same
endpoint; a host that comes back before the store host's old launcher has ended would otherwise
join the dying store of the failed attempt and fail with it.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from trainer.run.contract import CONTRACT_VERSION, FINAL_STATES, process_start_ticks, read_status, write_atomic
from trainer.run.control import stop_asked

SIOCGIFADDR = 0x8915
GENERATION_KEY = "dflash/generation"
REJOIN_FILE = ".rendezvous.json"  # RUNDIR/.rendezvous.json: the store generation this host joined last


def interface_of(address: str) -> str | None:
    """The network interface whose (primary IPv4) address is `address`, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def write_status(run_dir: Path, status: dict) -> None:
    status["heartbeat"] = time.time()
    write_atomic(run_dir / "status.json", json.dumps(status, indent=1).encode())


def initial_status(run_dir: Path, args: argparse.Namespace) -> dict:
    """What `run start` reads until the rank writes its own: this launcher, waiting for the others."""
    pid = os.getpid()
    now = time.time()
    return {"version": CONTRACT_VERSION, "run_id": run_dir.name, "state": "starting", "pid": pid, "pid_start": process_start_ticks(pid),
            "step": 0, "total_steps": None, "started": now, "heartbeat": now, "loss": None, "acc": None, "tau": None,
            "tokens_per_s": None, "gpus": [], "last_checkpoint": None, "recompiles": 0, "error": None,
            "distributed": {"nnodes": args.nnodes, "rendezvous": args.rdzv_endpoint, "joined": False,
                            "launcher_pid": pid}}


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by signal {-code} ({name})"
    return f"exited with status {code}"


def record_failure(run_dir: Path, message: str, status: dict) -> None:
    """Mark the rank failed unless it already wrote a final state itself."""
    current = read_status(run_dir) or status
    if current.get("state") in FINAL_STATES:
        return
    error = {"message": message, "traceback": "", "thread": "launcher"}
    current.update(state="failed", error=error)
    write_status(run_dir, current)
    line = json.dumps({"event": "error", "time": time.time(), "step": current.get("step", 0), **error})
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(line + "\n")
    print(f"[{time.strftime('%H:%M:%S')}] FAILED: {message}", flush=True)


class StoppedBeforeStart(Exception):
    pass


def forward_sigterm(run_dir: Path) -> None:
    """SIGTERM to this launcher (`run stop --now`) goes to the rank, which checkpoints and stops
    at its next step boundary (with every other host); the launcher then ends with it."""
    def forward(_signum: int, _frame: FrameType | None) -> None:
        status = read_status(run_dir) or {}
        pid, start = status.get("pid"), status.get("pid_start")
        if isinstance(pid, int) and pid != os.getpid() and process_start_ticks(pid) == start:
            os.kill(pid, signal.SIGTERM)
        else:  # still in the rendezvous: nothing to checkpoint
            raise StoppedBeforeStart("stopped (SIGTERM) before the rank started")

    signal.signal(signal.SIGTERM, forward)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def host_store(endpoint: str, timeout_s: float) -> tuple[object, str]:
    """The store host's TCPStore at the endpoint, with a new generation in it. torchrun's c10d
    rendezvous (is_host=1) opens the same host and port multi-tenant, so it shares this server;
    returns (the store, kept alive by the caller; its generation)."""
    import uuid
    from datetime import timedelta

    from torch.distributed import TCPStore

    host, port = split_endpoint(endpoint)
    store = TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                     timeout=timedelta(seconds=timeout_s))
    generation = uuid.uuid4().hex
    store.set(GENERATION_KEY, generation)
    return store, generation


def store_generation(endpoint: str) -> str | None:
    """The generation of the store answering at the endpoint now, or None (none answers yet)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    host, port = split_endpoint(endpoint)
    try:  # a plain connect first: TCPStore's own retries log a stack of errors per refused try
        socket.create_connection((host, port), timeout=1.0).close()
        client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=2))
        if not client.check([GENERATION_KEY]):
            return None
        return client.get(GENERATION_KEY).decode()
    except (OSError, RuntimeError, ValueError):  # refused, reset, DistNetworkError (a RuntimeError)
        return None


def wait_for_new_store(endpoint: str, last: str | None, timeout_s: float, poll_s: float = 0.5,
                       stop_asked: Callable[[], bool] = lambda: False) -> str:
    """Wait until the store at the endpoint carries a generation other than `last` (the one this
    host joined before): the store host's new launcher is up. Returns it. An operator's stop
    meanwhile (stop_asked) ends the wait: the other hosts are not coming back."""
    deadline = time.monotonic() + timeout_s
    while True:
        generation = store_generation(endpoint)
        if generation is not None and generation != last:
            return generation
        if stop_asked():
            raise StoppedBeforeStart("stopped by the operator while waiting for the other hosts")
        if time.monotonic() > deadline:
            what = "only the store of the last attempt answers" if generation else "no store answers"
            raise TimeoutError(f"the rendezvous store at {endpoint} did not come up within {timeout_s:.0f} s ({what})")
        time.sleep(poll_s)


def read_rejoin(run_dir: Path) -> str | None:
    try:
        generation = json.loads((run_dir / REJOIN_FILE).read_text()).get("generation")
    except (OSError, ValueError, AttributeError):
        return None
    return generation if isinstance(generation, str) else None


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    conf = [f"join_timeout={int(args.join_timeout)}", f"is_host={1 if args.store_host else 0}"]
    argv = ["--nnodes", str(args.nnodes), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-id", args.rdzv_id, "--rdzv-conf", ",".join(conf),
            "--max-restarts", "0", "--monitor-interval", "0.2",
            # SIGTERM is ours (forward_sigterm): torchrun's own handling would SIGKILL the rank
            # 30 s later, in the middle of the final checkpoint of a large drafter
            "--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT"]
    if args.local_addr:
        argv += ["--local-addr", args.local_addr]
    argv += ["-m", "trainer", "--config", args.config, "--run-dir", args.run_dir]
    if args.resume is not None:
        argv += ["--resume", args.resume]
    return argv


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer launch", description="One host's rank of a run across hosts.")
    p.add_argument("--nnodes", type=int, required=True, help="hosts in the run (one rank each)")
    p.add_argument("--rdzv-endpoint", required=True, help="HOST:PORT of the rendezvous store")
    p.add_argument("--rdzv-id", required=True, help="the run id (same on every host)")
    p.add_argument("--store-host", action="store_true", help="this host serves the rendezvous store")
    p.add_argument("--local-addr", help="this host's address the other hosts reach")
    p.add_argument("--join-timeout", type=float, default=300.0, help="seconds to wait for every host to join")
    p.add_argument("--config", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--resume", default=None)
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.local_addr:
        interface = interface_of(args.local_addr)
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, said here so it does not warn
    status = initial_status(run_dir, args)
    write_status(run_dir, status)
    forward_sigterm(run_dir)
    print(f"[{time.strftime('%H:%M:%S')}] launch: rank of {args.nnodes} hosts, rendezvous {args.rdzv_endpoint} "
          f"(id {args.rdzv_id}{', serving the store' if args.store_host else ''}), "
          f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', '-')}", flush=True)

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    store = None  # the store host's server: alive as long as this launcher
    try:
        if args.store_host:
            store, generation = host_store(args.rdzv_endpoint, args.join_timeout)
        else:
            generation = wait_for_new_store(args.rdzv_endpoint, read_rejoin(run_dir), args.join_timeout,
                                            stop_asked=lambda: stop_asked(run_dir))
        write_atomic(run_dir / REJOIN_FILE, json.dumps({"generation": generation, "endpoint": args.rdzv_endpoint}).encode())
        run(parse_args(torchrun_argv(args)))
    except ChildFailedError as exc:
        failures = exc.failures
        first = failures[min(failures)] if failures else None
        what = describe_exit(first.exitcode) if first is not None else "failed"
        pid = f" (pid {first.pid})" if first is not None and first.pid and first.pid > 0 else ""
        record_failure(run_dir, f"the trainer process{pid} {what}", status)
        return 1
    except StoppedBeforeStart as exc:
        record_failure(run_dir, str(exc), status)
        return 1
    except BaseException as exc:  # noqa: BLE001 - rendezvous timeouts, a signal to the agent, ...
        message = f"{type(exc).__name__}: {exc}".strip()
        record_failure(run_dir, f"launch failed: {message}", status)
        return 1
    finally:
        del store
    final = read_status(run_dir) or {}
    if final.get("state") not in FINAL_STATES:
        record_failure(run_dir, "the trainer process ended without a final state", status)
        return 1
    return 0 if final.get("state") != "failed" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
