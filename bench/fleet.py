"""Fleet figures: deploy and `run list` across 1, 4, 16 and 32 targets on 8 nodes, with and without
100 ms of added round-trip latency, as seconds and the ratio to one target (same run).

    sudo PYTHONPATH=. python bench/fleet.py [--nodes 8] [--repeat 3] [--rtt 0,0.1] [--sizes 1,4,16,32]

Needs root (dflash_ops.testing.netns: 8 network namespaces, an OpenSSH sshd and a pct stand-in
each, 4 containers per node). Each figure is the median of --repeat runs of exactly what the
CLI does (`deploy T...` = deploy_many + target_options with --no-venv; `run list T...` =
map_by_node over list_runs), starting from no connection (like a fresh CLI process). A deploy
is a first deploy into empty containers (the trainer tree); each container holds 3 finished runs
for `run list`. Targets are spread over the nodes: 4 targets = 4 nodes, 16 = 8 nodes x 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from dflash_ops import connect
from dflash_ops.connect import open_container
from dflash_ops.deploy.push import deploy_many, deploy_target, target_options
from dflash_ops.fanout import map_by_node
from dflash_ops.inventory import load_inventory
from dflash_ops.runs import list_runs
from dflash_ops.testing.netns import Fleet, netns_unavailable_reason, start_fleet

CTIDS = (200, 201, 202, 203)
SIZES = (1, 4, 16, 32)


def spread(fleet: Fleet, n: int) -> list[str]:
    """n targets, round-robin over the nodes (n0-200, n1-200, ..., n0-201, ...)."""
    order = [f"{node.name}-{ctid}" for ctid in CTIDS for node in fleet.nodes]
    return order[:n]


def empty_containers(fleet: Fleet, targets: list[str]) -> None:
    for name in targets:
        node = fleet.target_node(name)
        base = node.base_dir(int(name.rsplit("-", 1)[1]))
        shutil.rmtree(base, ignore_errors=True)


class Sample:
    """Wall seconds, this (operator) process's CPU seconds, the nodes' CPU seconds (every sshd
    with all it ran: sessions, shells, the pct stand-in, helpers; all nodes share this machine's
    cores) and node commands run."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.wall = self.operator_cpu = self.node_cpu = 0.0
        self.commands = self.connections = 0

    def __enter__(self):
        self._t, self._cpu, self._nodes = time.monotonic(), time.process_time(), _nodes_cpu(self.fleet)
        return self

    def __exit__(self, *exc):
        self.wall = time.monotonic() - self._t
        self.operator_cpu = time.process_time() - self._cpu
        connect.close_all()  # each connection's sshd process is reaped, with its CPU, once it closes
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(node.sshd.session_pids() for node in self.fleet.nodes):
            time.sleep(0.1)
        self.node_cpu = _nodes_cpu(self.fleet) - self._nodes


def _nodes_cpu(fleet: Fleet) -> float:
    """utime+stime+cutime+cstime of every node's sshd listener: itself and its reaped descendants."""
    total = 0
    for node in fleet.nodes:
        fields = Path(f"/proc/{node.sshd.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def _transports(containers) -> list:
    return list({id(c.transport): c.transport for c in containers}.values())


def _commands(containers) -> int:
    return sum(t.commands_run for t in _transports(containers))


def _connections(containers) -> int:
    return sum(t.connections_opened for t in _transports(containers))


def deploy_sample(fleet: Fleet, inventory: Path, targets: list[str], first: bool = True) -> Sample:
    if first:
        empty_containers(fleet, targets)
    connect.close_all()
    inv = load_inventory(inventory)
    opened = []

    def opener(name):
        opened.append(open_container(inv, name))
        return opened[-1]

    with Sample(fleet) as sample:
        summaries = deploy_many(targets, opener, lambda c, name: deploy_target(c, **target_options(c.target, no_venv=True)))
    failed = [s for s in summaries if not s.ok]
    if failed:
        raise SystemExit(f"deploy failed: {failed[0].target}: {failed[0].error}")
    sample.commands, sample.connections = _commands(opened), _connections(opened)
    return sample


def list_sample(fleet: Fleet, inventory: Path, targets: list[str]) -> Sample:
    connect.close_all()
    inv = load_inventory(inventory)
    with Sample(fleet) as sample:
        containers = [open_container(inv, name) for name in targets]
        found = map_by_node(containers, list_runs, lambda c, e: e)
    bad = [r for r in found if isinstance(r, Exception)]
    if bad:
        raise SystemExit(f"run list failed: {bad[0]}")
    if any(not isinstance(runs, list) or len(runs) != 3 for runs in found):
        raise SystemExit("run list: expected 3 runs per target")
    sample.commands, sample.connections = _commands(containers), _connections(containers)
    return sample


def plant_runs(fleet: Fleet) -> None:
    """3 finished runs per container (status.json + a few log lines), as a trainer leaves them."""
    import json

    for node in fleet.nodes:
        for ctid in CTIDS:
            for k in range(3):
                run = node.base_dir(ctid) / "runs" / f"bench-{k}"
                run.mkdir(parents=True, exist_ok=True)
                (run / "status.json").write_text(json.dumps({
                    "version": 1, "state": "done", "pid": 1, "step": 100, "total_steps": 100,
                    "started": 1.8e9, "heartbeat": 1.8e9, "loss": 1.5, "gpus": []}))
                (run / "train.log").write_text("step 100\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench/fleet.py")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rtt", default="0,0.1", help="added round-trip latencies in seconds, comma-separated")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="target counts, comma-separated (first = baseline)")
    args = parser.parse_args(argv)
    reason = netns_unavailable_reason()
    if reason:
        print(f"bench/fleet.py: {reason}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="dflash-bench-fleet-"))
    fleet = start_fleet(workdir, nodes=args.nodes, ctids=CTIDS, connect_timeout=10, keepalive=15)
    try:
        assert fleet.inventory is not None  # start_fleet writes it
        inventories: dict[str, Path] = {}
        for rtt in (float(x) for x in args.rtt.split(",")):
            inventories[f"+{rtt * 1000:g} ms RTT" if rtt else "0 ms"] = fleet.with_latency(rtt) if rtt else fleet.inventory
        sizes = [int(x) for x in args.sizes.split(",")]
        rows = []
        for latency, inventory in inventories.items():
            for op in ("first deploy", "redeploy", "run list"):
                base = None
                for n in sizes:
                    targets = spread(fleet, n)
                    samples = []
                    for _ in range(args.repeat):
                        if op == "first deploy":
                            samples.append(deploy_sample(fleet, inventory, targets))
                        elif op == "redeploy":
                            samples.append(deploy_sample(fleet, inventory, targets, first=False))
                        else:
                            if not samples:
                                plant_runs(fleet)
                            samples.append(list_sample(fleet, inventory, targets))
                    mid = sorted(samples, key=lambda s: s.wall)[len(samples) // 2]
                    base = base or mid.wall
                    nodes = len({t.rsplit("-", 1)[0] for t in targets})
                    rows.append((latency, op, n, nodes, mid))
                    print(f"{latency:>14} {op:>12} {n:>3} targets on {nodes} nodes: {mid.wall:6.2f} s  "
                          f"{mid.wall / base:5.2f}x  operator cpu {mid.operator_cpu:5.2f} s  node cpu "
                          f"{mid.node_cpu:6.2f} s  {mid.commands} node commands, {mid.connections} connections  "
                          f"(walls: {', '.join(f'{s.wall:.2f}' for s in samples)})", flush=True)
        print()
        print("| latency | operation | targets (nodes) | seconds (median) | ratio to 1 target "
              "| operator CPU s | nodes' CPU s (all 8 share 2 cores) | node commands | SSH connections |")
        print("|---|---|---|---|---|---|---|---|---|")
        firsts: dict = {}
        for latency, op, n, nodes, mid in rows:
            first = firsts.setdefault((latency, op), mid.wall)
            print(f"| {latency} | {op} | {n} ({nodes}) | {mid.wall:.2f} | {mid.wall / first:.2f}x "
                  f"| {mid.operator_cpu:.2f} | {mid.node_cpu:.1f} | {mid.commands} | {mid.connections} |")
    finally:
        connect.close_all()
        fleet.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
