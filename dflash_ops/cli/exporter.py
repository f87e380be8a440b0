"""`dflash-ops exporter`: the inventory's runs for Prometheus (dflash_ops/exporter.py)."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Optional

import typer

from dflash_ops.cli.common import InventoryOption, fail


def parse_listen(text: str) -> tuple[str, int]:
    """HOST:PORT (PORT 0: any free port) -> (host, port); a usage error names what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        fail(f"--listen {text!r}: give HOST:PORT, e.g. 127.0.0.1:9108", 2)
    return host.strip("[]"), int(port)


def register(app: typer.Typer) -> None:
    @app.command("exporter")
    def exporter(
        listen: Annotated[str, typer.Option("--listen", help="HOST:PORT to serve /metrics on (e.g. 127.0.0.1:9108)")],
        targets: Annotated[Optional[list[str]], typer.Argument(help="Targets to export (default: all)")] = None,
        timeout: Annotated[float, typer.Option("--timeout", help="Seconds a scrape waits for the targets in all; one "
                                                                 "that has not answered is `dflash_target_up 0`")] = 5.0,
        no_gpus: Annotated[bool, typer.Option("--no-gpus", help="Do not sample the nodes' GPUs")] = False,
        inventory: InventoryOption = None,
    ) -> None:
        """Serve every inventory target's runs at http://HOST:PORT/metrics in Prometheus's text format:
        state, phase, step, loss, tau, tokens/s, tokens done and to go, ETA, per-GPU busy and memory,
        queue length; per-target timeouts, so one dead node never blocks a scrape (docs/prometheus.md)."""
        from dflash_ops.connect import open_container
        from dflash_ops.exporter import Collector, serve
        from dflash_ops.inventory import load_inventory

        if not timeout > 0:
            fail("--timeout must be more than 0", 2)
        host, port = parse_listen(listen)
        loaded = load_inventory(inventory)
        names = targets or sorted(loaded.targets)
        for name in names:
            loaded.target(name)  # a wrong name fails here, in one line
        collector = Collector({name: partial(open_container, loaded, name) for name in names}, timeout=timeout,
                              gpus=not no_gpus)
        try:
            serve(collector, host, port, ready=lambda p: typer.echo(
                f"serving {len(names)} target(s) at http://{host}:{p}/metrics", err=True))
        except OSError as exc:
            fail(f"cannot listen on {listen}: {exc.strerror or exc}", 1)
