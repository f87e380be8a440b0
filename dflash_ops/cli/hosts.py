"""`dflash-ops hosts`, `exec`, `inspect-source`: the command layer on the command line."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from dflash_ops import render
from dflash_ops.cli.common import (
    ARGV_CONTEXT,
    InventoryOption,
    check_timeout,
    fail,
    forwarded_stdin,
    open_target,
    write_stderr,
    write_stdout,
)
from dflash_ops.container import run_exec_plan
from dflash_ops.inventory import Node, load_inventory


def hosts(
    targets: Annotated[Optional[list[str]], typer.Argument(help="Targets to show (default: all).")] = None,
    inventory: InventoryOption = None,
) -> None:
    """List targets with their node, ctid, backend, base_dir, state (running/stopped/unreachable) and last doctor verdict.

    backend: what runs a simulated node's container (lxc: a real LXC container; directory: a
    directory with its own python); `-` for a real node's.

    Nodes are asked in parallel, one connection each: a dead node costs one connect timeout.
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from dflash_ops.doctor.verdicts import describe, last_verdict
    from dflash_ops.target_states import target_states

    inv = load_inventory(inventory)
    table = Table("target", "node", "ctid", "backend", "base_dir", "state", "doctor", box=None)
    for name in targets or []:
        inv.target(name)
    for s in target_states(inv, targets or None):
        state = s.state if not s.detail else f"{s.state} ({s.detail})"
        ctid = str(s.target.ctid) if s.target.node.pct else "-"
        backend = s.target.node.kind.backend(s.target.ctid) or "-"
        cells = (s.target.name, s.target.node.name, ctid, backend, s.target.base_dir, state,
                 describe(last_verdict(s.target)))
        table.add_row(*(escape(cell) for cell in cells))  # what pct or an error said is text, not markup
    console = Console()
    if not console.is_terminal:
        console = Console(width=1000)
    console.print(table)


def exec_(
    target: Annotated[str, typer.Argument(help="Target name from the inventory.")],
    argv: Annotated[list[str], typer.Argument(help="The command inside the container, after `--`.")],
    inventory: InventoryOption = None,
    print_command: Annotated[bool, typer.Option("--print-command", help="Print every rendered layer; run nothing.")] = False,
    timeout: Annotated[Optional[float], typer.Option("--timeout", help="Kill the command after this many seconds (coreutils `timeout` inside the container; exit 124).")] = None,
    no_stdin: Annotated[bool, typer.Option("-n", "--no-stdin", help="Do not forward stdin (the command reads EOF), like ssh -n.")] = False,
) -> None:
    """Run ARGV in TARGET's container, byte for byte: `dflash-ops exec host200 -- python3 -c ...`.

    Streams stdout/stderr live and exits with the remote exit status. Stdin is forwarded byte
    for byte (binary safe; its EOF closes the command's stdin) unless it is a terminal or -n.
    """
    check_timeout(timeout)
    argv = argv[1:] if argv[:1] == ["--"] else argv
    if not argv:
        fail("no command given: dflash-ops exec TARGET -- ARGV...", 2)
    container = open_target(inventory, target)
    plan = render.exec_plan(argv, timeout)  # what --print-command shows is this plan, and it is what runs
    if print_command:
        for label, value in [*plan.layers(), *container.render(list(plan.argv)).layers()]:
            typer.echo(f"{label}: {value}")
        typer.echo(f"transport: {_describe_transport(container.target.node)}")
        return
    result = run_exec_plan(container, plan, stdin=None if no_stdin else forwarded_stdin(),
                           on_line=write_stdout, on_stderr_line=write_stderr)
    raise typer.Exit(result.exit_code)


def inspect_source(
    target: Annotated[str, typer.Argument(help="Target name from the inventory.")],
    module: Annotated[str, typer.Argument(help="Dotted module name, e.g. torch._dynamo.eval_frame.")],
    lines: Annotated[str, typer.Option("--lines", help="Line range A:B (1-based, inclusive).")] = "1:",
    inventory: InventoryOption = None,
) -> None:
    """Print numbered source lines of MODULE as the container's python finds it."""
    container = open_target(inventory, target)
    result = container.helper("inspect-source", [module, "--lines", lines], on_line=write_stdout,
                              on_stderr_line=write_stderr)
    raise typer.Exit(result.exit_code)


def _describe_transport(node: Node) -> str:
    if node.transport == "local":
        return f"local node {node.name!r}: /bin/sh -c NODE_COMMAND"
    user = f"{node.user}@" if node.user else ""
    port = f" port {node.port}" if node.port else ""
    return f"SSH exec request to {user}{node.address}{port} (node {node.name!r}) carries NODE_COMMAND"


def register(app: typer.Typer) -> None:
    app.command("hosts")(hosts)
    app.command("exec", context_settings=ARGV_CONTEXT)(exec_)
    app.command("inspect-source")(inspect_source)
