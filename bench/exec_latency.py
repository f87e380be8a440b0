"""How much one `Container.exec` costs: pct invocations, SSH connections, and latency.

Latency: N runs of the same rendered command over the reused Fabric connection vs a fresh
OpenSSH `ssh` process per command (the hand-written way), against a throw-away sshd started by
dflash_ops.testing.sshd (the integration fixture's code). Ratio is from this run only.

    PYTHONPATH=$PWD python bench/exec_latency.py [-n 30]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from dflash_ops.container import Container
from dflash_ops.inventory import load_inventory
from dflash_ops.testing.sshd import start_sshd
from dflash_ops.transport.ssh import SSHTransport


def counting_pct(node_dir: Path) -> Path:
    """A pct wrapper that logs each invocation, then runs the fixture's pct."""
    log = node_dir / "pct-calls.log"
    wrapper = node_dir / "bin" / "pct-counting"
    wrapper.write_text("#!/bin/sh\necho x >> " + shlex.quote(str(log)) + "\nexec "
                       + shlex.quote(str(node_dir / "bin" / "pct")) + ' "$@"\n')
    wrapper.chmod(0o755)
    inventory = node_dir / "inventory-counting.yaml"
    inventory.write_text((node_dir / "inventory.yaml").read_text().replace(
        str(node_dir / "bin" / "pct"), str(wrapper)))
    return inventory


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def describe(label: str, samples: list[float]) -> str:
    return f"{label:<44} mean {statistics.mean(samples) * 1e3:8.2f} ms   median {statistics.median(samples) * 1e3:8.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=30)
    n = parser.parse_args().n
    with tempfile.TemporaryDirectory() as tmp:
        node = start_sshd(Path(tmp))
        try:
            inventory = counting_pct(node.workdir)
            target = load_inventory(inventory).target("host200")
            transport = SSHTransport(target.node)
            container = Container(target, transport)
            container.exec(["true"], check=True)  # connect once

            log = node.workdir / "pct-calls.log"
            calls_before = len(log.read_text().splitlines())
            logins_before = node.accepted_logins()
            runs_before = transport.commands_run
            fabric_exec = timed(lambda: container.exec(["true"], check=True), n)
            print(f"per exec: {(len(log.read_text().splitlines()) - calls_before) / n:.2f} pct invocations, "
                  f"{(node.accepted_logins() - logins_before) / n:.2f} new SSH connections, "
                  f"{(transport.commands_run - runs_before) / n:.2f} SSH channels "
                  f"(connections opened in all: {transport.connections_opened})")

            ssh_argv = ["ssh", "-q", "-p", str(node.port), "-i", str(node.client_key),
                        "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "ControlMaster=no",
                        "-o", "ControlPath=none", "-o", "StrictHostKeyChecking=yes",
                        "-o", f"UserKnownHostsFile={node.known_hosts}", "-F", "/dev/null",
                        f"{node.user}@127.0.0.1"]
            pct_true = container.render(["true"]).command
            fresh_exec = timed(lambda: subprocess.run([*ssh_argv, pct_true], check=True), n)
            fabric_true = timed(lambda: transport.run("true"), n)
            fresh_true = timed(lambda: subprocess.run([*ssh_argv, "true"], check=True), n)

            print(f"latency, N={n} each:")
            print(describe("exec ['true'] (pct stand-in), reused Fabric", fabric_exec))
            print(describe("same command, fresh `ssh` process each", fresh_exec))
            print(describe("node `true`, reused Fabric connection", fabric_true))
            print(describe("node `true`, fresh `ssh` process each", fresh_true))
            print(f"ratio fresh ssh / reused (pct exec true): mean {statistics.mean(fresh_exec) / statistics.mean(fabric_exec):.2f}x, "
                  f"median {statistics.median(fresh_exec) / statistics.median(fabric_exec):.2f}x")
            print(f"ratio fresh ssh / reused (node true):     mean {statistics.mean(fresh_true) / statistics.mean(fabric_true):.2f}x, "
                  f"median {statistics.median(fresh_true) / statistics.median(fabric_true):.2f}x")
            transport.close()
        finally:
            node.close()


if __name__ == "__main__":
    main()
