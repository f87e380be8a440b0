"""`dflash-ops run start|list|status|checkpoint|stop|resume`, `logs`, `metrics`, `pull`.

A thin skin over dflash_ops.runs: every command is one library call (or two, when RUN is left
out and the latest run is looked up first). Run ids go to stdout; hints go to stderr.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from dflash_ops.cli.common import InventoryOption, check_timeout, fail, open_target, write_stdout
from dflash_ops.cli.tables import print_runs_table as _print_table

if TYPE_CHECKING:
    from dflash_ops.runs.info import RunInfo

run_app = typer.Typer(help="Start, inspect, checkpoint, stop and resume training runs.", no_args_is_help=True)

Target = Annotated[str, typer.Argument(help="Target name from the inventory.")]
Run = Annotated[str, typer.Argument(help="Run id (see `dflash-ops run list TARGET`).")]
OptionalRun = Annotated[Optional[str], typer.Argument(help="Run id; default: the target's latest run.")]
Timeout = Annotated[float, typer.Option("--timeout", help="Give up waiting after this many seconds.")]


def _hint(text: str) -> None:
    typer.echo(text, err=True)


def _announce(run_id: str, verb: str, target: str) -> None:
    """The run id alone on stdout (for scripts), the follow hint on stderr."""
    typer.echo(run_id)
    _hint(f"{verb} {run_id} on {target}; follow it: dflash-ops logs {target} {run_id} -f")


def _parse_gpus(text: str | None) -> list[int] | None:
    from dflash_ops.runs.info import RunError
    from dflash_ops.runs.lifecycle import parse_gpus

    if text is None:
        return None
    try:
        return parse_gpus(text)
    except RunError as e:
        fail(str(e), 2)


def start(
    targets: Annotated[list[str], typer.Argument(metavar="TARGET...", help="Target name(s) from the inventory; several = one run across hosts.")],
    config: Annotated[Path, typer.Option("--config", help="Trainer config YAML (local file), e.g. trainer/configs/tiny-cpu.yaml.")],
    name: Annotated[Optional[str], typer.Option("--name", help="Run id prefix (default: run).")] = None,
    gpus: Annotated[Optional[str], typer.Option("--gpus", help="GPUs the run holds, e.g. 0,1 (default: the target's).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Start even when the doctor's fast checks fail.")] = False,
    inventory: InventoryOption = None,
) -> None:
    """Start the trainer detached from TARGET's current release; prints the run id.

    Several targets (one container per node): one run across hosts, a torchrun rank on each,
    one run id (docs/multi-node.md). First the doctor's fast subset (`dflash-ops doctor --fast`)
    on each: a run that cannot succeed is refused, naming the failed check, unless --force."""
    from dflash_ops.runs import start_run

    if not config.is_file():
        fail(f"--config {config}: no such file", 2)
    if len(targets) > 1:
        from dflash_ops.cli import group_runs

        run_id = group_runs.start(inventory, targets, config, name, _parse_gpus(gpus),
                                  lambda c: _preflight(c, config, _parse_gpus(gpus), force))
        _announce(run_id, "started", " ".join(targets))
        return
    target = targets[0]
    container = open_target(inventory, target)
    _preflight(container, config, _parse_gpus(gpus), force)
    run_id = start_run(container, config, name=name, gpus=_parse_gpus(gpus))
    _announce(run_id, "started", target)


def _preflight(container, config: Path, gpus: list[int] | None, force: bool) -> None:
    from dflash_ops.cli.doctor import print_report
    from dflash_ops.doctor import plan_for, preflight

    report = preflight(container, plan_for(container.target, gpus, config))
    if not report.failed:
        return
    print_report(container.target, report, err=True)
    names = "; ".join(f"{c.name}: {c.measured} (needs {c.needed})" for c in report.failed)
    if force:
        _hint(f"--force: starting although doctor failed: {names}")
        return
    fail(f"refusing to start on {container.target.name}, doctor failed: {names}; fix it or pass --force")


def list_(
    targets: Annotated[list[str], typer.Argument(help="Target names from the inventory (one or more).")],
    inventory: InventoryOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the helper's documents as JSON.")] = False,
) -> None:
    """Every run of each TARGET (one pct invocation each): state, step, loss, tokens/s, heartbeat age, release.

    Several targets are asked in parallel, one connection per node; an unreachable one is
    reported on stderr (exit 255) after the others are shown.
    """
    from dflash_ops.runs import list_runs

    if len(targets) == 1:
        container = open_target(inventory, targets[0])
        runs = list_runs(container)
        if as_json:
            typer.echo(json.dumps([r.raw for r in runs], indent=1, sort_keys=True))
        elif not runs:
            _hint(f"no runs on {targets[0]} yet")
        else:
            _print_table(runs)
        return
    from dflash_ops.fanout import map_by_node

    containers = [open_target(inventory, name) for name in targets]
    found: list[list[RunInfo] | Exception] = map_by_node(containers, list_runs, lambda c, e: e)
    failed: list[tuple[str, Exception]] = []
    listed: list[tuple[str, list[RunInfo]]] = []
    for name, r in zip(targets, found):
        if isinstance(r, Exception):
            failed.append((name, r))
        else:
            listed.append((name, r))
    if as_json:
        doc: dict[str, object] = {name: [r.raw for r in runs] for name, runs in listed}
        doc.update({name: {"error": str(e)} for name, e in failed})
        typer.echo(json.dumps(doc, indent=1, sort_keys=True))
    else:
        _print_table([info for _name, runs in listed for info in runs],
                     targets=[name for name, runs in listed for _info in runs])
        for name, runs in listed:
            if not runs:
                _hint(f"no runs on {name} yet")
    for name, error in failed:
        typer.echo(f"dflash-ops: error: {name}: {error}", err=True)
    if failed:
        from dflash_ops.errors import TransportError

        raise typer.Exit(255 if any(isinstance(e, TransportError) for _n, e in failed) else 1)


def status(
    target: Target,
    run: OptionalRun = None,
    inventory: InventoryOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the helper's document as JSON.")] = False,
) -> None:
    """One run's state (default: the latest run); a failed run shows why and the tail of its log."""
    from dflash_ops.runs import resolve_run
    from dflash_ops.runs.report import status_detail

    container = open_target(inventory, target)
    info = resolve_run(container, run)
    if group_of(info) is not None:
        from dflash_ops.cli import group_runs

        found, group = group_runs.group_members(inventory, target, info.run_id)
        if as_json:
            doc = {m.target: (m.info.raw if m.info else {"error": str(m.error)}) for m in found}
            typer.echo(json.dumps(doc, indent=1, sort_keys=True))
        else:
            group_runs.print_members(found, group)
        return
    if as_json:
        typer.echo(json.dumps(info.raw, indent=1, sort_keys=True))
        return
    _print_table([info])
    for line in status_detail(info):
        typer.echo(line)


def checkpoint(
    target: Target,
    run: Run,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the trainer has written it.")] = False,
    timeout: Timeout = 600.0,
    inventory: InventoryOption = None,
) -> None:
    """Ask a live run for a checkpoint at its next step boundary."""
    from dflash_ops.runs import checkpoint_run

    check_timeout(timeout)
    found = _group(inventory, target, run)
    if found is not None:
        from dflash_ops.cli import group_runs

        group_runs.checkpoint(found, run, wait, timeout)
        return
    container = open_target(inventory, target)
    request_id, path = checkpoint_run(container, run, wait=wait, timeout=timeout)
    if path is None:
        typer.echo(f"checkpoint requested ({request_id}); wait for it with --wait")
    else:
        typer.echo(f"checkpoint {path} written (request {request_id})")


def stop(
    target: Target,
    run: Run,
    now: Annotated[bool, typer.Option("--now", help="SIGTERM: the trainer checkpoints and stops at once.")] = False,
    kill: Annotated[bool, typer.Option("--kill", help="SIGKILL: no checkpoint (a trainer that no longer answers).")] = False,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="Return once asked; do not wait for the final state.")] = False,
    timeout: Timeout = 600.0,
    inventory: InventoryOption = None,
) -> None:
    """Stop a run: a final checkpoint, then state `stopped` (resume it with `run resume`)."""
    from dflash_ops.runs import stop_run

    if now and kill:
        fail("--now and --kill exclude each other", 2)
    check_timeout(timeout)
    found = _group(inventory, target, run)
    if found is not None:
        from dflash_ops.cli import group_runs

        group_runs.stop(found, run, now, kill, not no_wait, timeout)
        return
    container = open_target(inventory, target)
    info = stop_run(container, run, now=now, kill=kill, wait=not no_wait, timeout=timeout)
    typer.echo(f"{info.run_id}: {info.effective_state} at step {info.step if info.step is not None else '-'}; "
               f"last checkpoint {info.last_checkpoint or 'none'}")
    if info.effective_state == "failed" and not kill:
        raise typer.Exit(1)


def resume(
    target: Target,
    run: Run,
    from_step: Annotated[Optional[int], typer.Option("--from", help="Checkpoint step to resume from (default: latest).")] = None,
    gpus: Annotated[Optional[str], typer.Option("--gpus", help="GPUs the run holds, e.g. 0,1 (default: the target's).")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", help="A new trainer config for the rest of the run (default: the run's own).")] = None,
    inventory: InventoryOption = None,
) -> None:
    """Restart a stopped (or failed) run from its checkpoint on the current release; the step count continues."""
    from dflash_ops.runs import resume_run, start_run

    if config is not None and not config.is_file():
        fail(f"--config {config}: no such file", 2)
    found = _group(inventory, target, run)
    if found is not None:
        from dflash_ops.cli import group_runs

        if config is not None:
            fail("--config: a run across hosts resumes on its own config (edit each member's "
                 "runs/RUN/config.input.yaml to change it)", 2)
        group_runs.resume(found, run, from_step, _parse_gpus(gpus))
        return
    container = open_target(inventory, target)
    if config is None:
        run_id = resume_run(container, run, from_step=from_step, gpus=_parse_gpus(gpus))
    else:
        run_id = start_run(container, config, resume="latest" if from_step is None else from_step,
                           gpus=_parse_gpus(gpus), run_id=run)
    _announce(run_id, "resumed", target)


def logs(
    target: Target,
    run: OptionalRun = None,
    follow: Annotated[bool, typer.Option("-f", "--follow", help="Keep following until the run reaches a final state.")] = False,
    lines: Annotated[Optional[int], typer.Option("-n", "--lines", min=0, help="Start with the last N lines (default: all).")] = None,
    rank: Annotated[Optional[int], typer.Option("--rank", min=0, help="A run across hosts: the log of this rank (default: TARGET's).")] = None,
    inventory: InventoryOption = None,
) -> None:
    """Print a run's train.log, byte for byte; with -f follow it, resuming after a dropped connection."""
    if rank is not None:
        from dflash_ops.cli import group_runs
        from dflash_ops.runs import resolve_run

        run = run if run is not None else resolve_run(open_target(inventory, target), None).run_id
        target = group_runs.rank_target(inventory, target, run, rank)
    _follow_cli(target, run, "train.log", follow, lines, inventory, write_stdout)


def metrics(
    target: Target,
    run: OptionalRun = None,
    follow: Annotated[bool, typer.Option("-f", "--follow", help="Keep following until the run reaches a final state.")] = False,
    lines: Annotated[Optional[int], typer.Option("-n", "--lines", min=0, help="Start with the last N events (default: all).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The raw JSON lines of metrics.jsonl.")] = False,
    inventory: InventoryOption = None,
) -> None:
    """A compact line per metrics event (step: loss, acc, lr, grad norm, tokens/s; eval: tau)."""
    if as_json:
        _follow_cli(target, run, "metrics.jsonl", follow, lines, inventory, write_stdout)
        return
    _follow_cli(target, run, "metrics.jsonl", follow, lines, inventory, _MetricPrinter().line)


class _MetricPrinter:
    def __init__(self):
        self.total_steps: int | None = None

    def line(self, raw: bytes) -> None:
        from dflash_ops.runs.report import metric_line

        try:
            event = json.loads(raw)
        except ValueError:
            write_stdout(raw)
            return
        if event.get("event") == "start":
            self.total_steps = event.get("total_steps")
        write_stdout((metric_line(event, self.total_steps) + "\n").encode())


def _follow_cli(target, run, name, follow, lines, inventory, on_line) -> None:
    from dflash_ops.runs import follow_file, resolve_run, run_status

    container = open_target(inventory, target)
    try:
        run_id = run if run is not None else resolve_run(container, None).run_id
        follow_file(container, run_id, name, on_line, tail_lines=lines, follow=follow,
                    on_retry=lambda error, delay: _hint(f"dflash-ops: {error}; retrying in {delay:.1f}s"),
                    on_truncated=lambda reached, size: _hint(
                        f"dflash-ops: warning: {name} of {run_id} was truncated or replaced at byte {reached} "
                        f"(now {size} bytes); what was written before that and not yet shown is lost; "
                        "following from its start"))
        if not follow:
            return
        info = run_status(container, run_id)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    _hint(f"{run_id}: {info.effective_state} at step {info.step if info.step is not None else '-'}")
    if info.effective_state == "failed":
        raise typer.Exit(1)


def pull(
    target: Target,
    run: Run,
    dest: Annotated[Path, typer.Argument(help="Local directory; the checkpoint lands in DEST/step_N.")],
    checkpoint_: Annotated[str, typer.Option("--checkpoint", help="'latest' or a step number.")] = "latest",
    inventory: InventoryOption = None,
) -> None:
    """Copy a checkpoint out, each file verified against its manifest; a second pull resumes."""
    from dflash_ops.runs import pull_checkpoint

    if checkpoint_ != "latest" and not checkpoint_.isdigit():
        fail(f"--checkpoint {checkpoint_!r}: expected 'latest' or a step number", 2)
    found = _group(inventory, target, run)
    if found is not None:
        from dflash_ops.cli import group_runs

        local = group_runs.pull(found, run, checkpoint_, dest)
    else:
        container = open_target(inventory, target)
        local = pull_checkpoint(container, run, checkpoint_, dest)
    manifest = json.loads((local / "manifest.json").read_text())
    size = sum(f["size"] for f in manifest["files"].values())
    typer.echo(f"{local}: {len(manifest['files'])} files, {size / 1e6:.1f} MB, sha256 verified")


def group_of(info):
    from dflash_ops.runs.group import group_of as of

    return of(info)


def _group(inventory, target: str, run: str):
    """The members of `run` when it is a run across hosts, else None (also when the run cannot
    be found: the one-host command then reports that, after its own checks of its arguments)."""
    from dflash_ops.cli import group_runs
    from dflash_ops.runs.info import RunError

    try:
        found, group = group_runs.members_or_raise(inventory, target, run)
    except RunError:
        return None
    return found if group is not None else None


def register(app: typer.Typer) -> None:
    run_app.command("start")(start)
    run_app.command("list")(list_)
    run_app.command("status")(status)
    run_app.command("checkpoint")(checkpoint)
    run_app.command("stop")(stop)
    run_app.command("resume")(resume)
    app.add_typer(run_app, name="run")
    app.command("logs")(logs)
    app.command("metrics")(metrics)
    app.command("pull")(pull)
