"""Deploy figures: first deploy, redeploy unchanged, redeploy with one file of 2,000 changed.

    PYTHONPATH=. python bench/deploy.py [--files 2000] [--baseline-files 200] [--tiers sim,sshd]

Against the baseline users have today, measured in the same run: one `pct push` per file
(Container.push: copy to the node, `pct push`, sha256 check), timed on --baseline-files files
and scaled to the tree's size. Prints a markdown table (append it to bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from dflash_ops.container import Container
from dflash_ops.deploy.push import deploy_target
from dflash_ops.inventory import load_inventory
from dflash_ops.testing.sshd import sshd_unavailable_reason, start_sshd


def make_tree(root: Path, files: int) -> Path:
    package = root / "src" / "trainer"
    for i in range(files):
        path = package / f"pkg{i % 40}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# module {i}\nVALUE = {i}\n" + "x = 1\n" * 60)
    return package


def sim_container(root: Path) -> Container:
    from dflash_ops.transport.local import LocalTransport
    from tests.conftest import write_sim_inventory

    return Container(load_inventory(write_sim_inventory(root)).target("host200"), LocalTransport())


def sshd_container(node) -> Container:
    from dflash_ops.transport.ssh import SSHTransport

    target = load_inventory(node.inventory).target("host200")
    return Container(target, SSHTransport(target.node))


def measure(container: Container, package: Path) -> list[tuple[str, float, int, int, int]]:
    rows = []
    for label, change in [("(a) first deploy", None), ("(b) redeploy, nothing changed", None),
                          ("(c) redeploy, 1 file changed", package / "pkg7" / "mod7.py")]:
        if change is not None:
            change.write_text(change.read_text() + "# changed\n")
        s = deploy_target(container, source=package, venv=None)
        rows.append((label, s.seconds, s.bytes_sent, s.pct_calls, s.files_sent))
    return rows


def baseline(container: Container, package: Path, count: int, total: int) -> tuple[float, int, int]:
    """Seconds, bytes and pct invocations for one `pct push` per file, scaled to `total` files."""
    files = sorted(p for p in package.rglob("*.py"))[:count]
    dest = f"{container.base_dir}/baseline"
    container.exec(["mkdir", "-p", dest], check=True)
    before = container.transport.commands_run
    started = time.monotonic()
    sent = 0
    for path in files:
        container.push(path, f"{dest}/{path.name}")
        sent += path.stat().st_size
    seconds = time.monotonic() - started
    calls = container.transport.commands_run - before
    scale = total / len(files)
    return seconds * scale, int(sent * scale), int(calls * scale)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--baseline-files", type=int, default=200)
    parser.add_argument("--tiers", default="sim,sshd")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-deploy-"))
    package = make_tree(work, args.files)
    print(f"tree: {args.files} files, {sum(p.stat().st_size for p in package.rglob('*.py'))} bytes\n")
    print("| tier | case | seconds | bytes sent | pct invocations | files sent |")
    print("|---|---|---:|---:|---:|---:|")
    node = None
    try:
        for tier in args.tiers.split(","):
            if tier == "sshd":
                reason = sshd_unavailable_reason()
                if reason:
                    print(f"| sshd | skipped: {reason} | | | | |")
                    continue
                node = start_sshd(work / "sshd")
                container = sshd_container(node)
            else:
                container = sim_container(work / "sim")
            rows = measure(container, package)
            for label, seconds, sent, calls, nfiles in rows:
                print(f"| {tier} | {label} | {seconds:.3f} | {sent} | {calls} | {nfiles} |")
            b_seconds, b_bytes, b_calls = baseline(container, package, args.baseline_files, args.files)
            print(f"| {tier} | baseline: 1 `pct push` per file (x{args.files}, scaled from {args.baseline_files}) "
                  f"| {b_seconds:.3f} | {b_bytes} | {b_calls} | {args.files} |")
            first = rows[0][1]
            print(f"| {tier} | ratio baseline / (a) first deploy | {b_seconds / first:.1f}x | | "
                  f"{b_calls / max(rows[0][3], 1):.0f}x | |")
            container.transport.close()
    finally:
        if node is not None:
            node.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
