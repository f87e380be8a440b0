"""`dflash-ops run start|list|status|checkpoint|stop|resume`, `logs`, `metrics`, `pull`.

A thin skin over dflash_ops.runs: every command is one library call (or two, when RUN is left
out and the latest run is looked up first). Run ids go to stdout; hints go to stderr.

A run across hosts (dflash_ops.runs.group: `run start` with several targets, or a run whose
directory on TARGET holds a group.json) is acted on as a whole, with one row or line per member.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from dflash_ops.cli.common import InventoryOption, check_timeout, fail, open_target, parse_gpus, write_stdout

if TYPE_CHECKING:
    from dflash_ops.container import Container
    from dflash_ops.runs.group import Member
    from dflash_ops.runs.info import RunInfo

run_app = typer.Typer(help="Start, inspect, checkpoint, stop and resume training runs.", no_args_is_help=True)

Target = Annotated[str, typer.Argument(help="Target name from the inventory.")]
Run = Annotated[str, typer.Argument(help="Run id (see `dflash-ops run list TARGET`).")]
OptionalRun = Annotated[Optional[str], typer.Argument(help="Run id; default: the target's latest run.")]
Timeout = Annotated[float, typer.Option("--timeout", help="Give up waiting after this many seconds.")]
Restart = Annotated[Optional[str], typer.Option(
    "--restart", metavar="no|on-failure[:N]",
    help="on-failure[:N]: after a crash (non-zero exit, a kill, OOM) resume from the latest checkpoint, at most N "
         "times (default 3); each restart and its reason show in `run status`, the dashboard and metrics.jsonl. "
         "Across hosts every host's rank restarts, all from the newest checkpoint of the group. "
         "`run stop` still stops for good.")]
Queue = Annotated[bool, typer.Option(
    "--queue", help="When its GPUs are held, queue the run in the container (FIFO per GPU) instead of refusing; it "
                    "starts by itself once they are free. See `dflash-ops run queue TARGET`; `run stop` takes it out.")]
NotifyUrls = Annotated[Optional[list[str]], typer.Option(
    "--notify", metavar="URL",
    help="A webhook that gets a JSON POST on every state change (queued, started, restart, stopped, failed, done), "
         "added to the inventory's notify:; env:NAME reads the URL from $NAME. Repeatable. Shown redacted.")]
Gpus = Annotated[Optional[str], typer.Option("--gpus", help="GPUs the run holds, e.g. 0,1 (default: the target's).")]
Follow = Annotated[bool, typer.Option("-f", "--follow", help="Keep following until the run reaches a final state.")]


def _hint(text: str) -> None:
    typer.echo(text, err=True)


def _announce(run_id: str, verb: str, targets: list[str]) -> None:
    """The run id alone on stdout (for scripts), the follow hint on stderr: a command `logs` takes
    (one target; a run across hosts is followed through its first member, `--rank` for another)."""
    typer.echo(run_id)
    rank = " (another host's rank: --rank N)" if len(targets) > 1 else ""
    _hint(f"{verb} {run_id} on {' '.join(targets)}; follow it: dflash-ops logs {targets[0]} {run_id} -f{rank}")


def _echo_json(doc: object) -> None:
    typer.echo(json.dumps(doc, indent=1, sort_keys=True))


def _at_step(info: RunInfo) -> str:
    return f"{info.run_id}: {info.effective_state} at step {info.step if info.step is not None else '-'}"


def _print_table(runs: list[RunInfo], targets: list[str] | None = None) -> None:
    """The runs table (rich, one row per run; a first column `target` when targets are given)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from dflash_ops.runs.report import STATUS_COLUMNS, status_row

    table = Table(*(("target",) if targets is not None else ()), *STATUS_COLUMNS, box=None)
    for i, info in enumerate(runs):  # Text cells: a value from a run directory is not rich markup
        table.add_row(*(Text(c) for c in ((targets[i],) if targets is not None else ())),
                      *(Text(cell) for cell in status_row(info)))
    console = Console() if sys.stdout.isatty() else Console(width=1000)
    console.print(table)


def start(
    targets: Annotated[list[str], typer.Argument(metavar="TARGET...", help="Target name(s) from the inventory; several = one run across hosts.")],
    config: Annotated[Path, typer.Option("--config", help="Trainer config YAML (local file), e.g. trainer/configs/tiny-cpu.yaml.")],
    name: Annotated[Optional[str], typer.Option("--name", help="Run id prefix (default: run).")] = None,
    gpus: Gpus = None,
    force: Annotated[bool, typer.Option("--force", help="Start even when the doctor's fast checks fail.")] = False,
    restart: Restart = None,
    queue: Queue = False,
    notify: NotifyUrls = None,
    inventory: InventoryOption = None,
) -> None:
    """Start the trainer detached from TARGET's current release; prints the run id.

    Several targets (one container per node): one run across hosts, a torchrun rank on each,
    one run id (docs/multi-node.md). First the doctor's fast subset (`dflash-ops doctor --fast`)
    on each: a run that cannot succeed is refused, naming the failed check, unless --force."""
    from dflash_ops.runs import start_run
    from dflash_ops.runs.group import check_members, start_group
    from dflash_ops.runs.lifecycle import check_restart

    if not config.is_file():
        fail(f"--config {config}: no such file", 2)
    gpu_list = parse_gpus(gpus)
    check_restart(restart)
    if len(targets) > 1:
        check_members(targets)
        if queue:
            fail("--queue: a run across hosts is not queued (its ranks must start together); start it when the "
                 "GPUs of every member are free", 2)
    containers = [open_target(inventory, t) for t in targets]
    spec = _notify_spec(containers[0], notify or [])  # a group's events are told by its first member
    for container in containers:
        _preflight(container, config, gpu_list, force)
    if len(targets) > 1:
        run_id = start_group(containers, targets, config, name=name, gpus=gpu_list, restart=restart, notify=spec)
    else:
        run_id = start_run(containers[0], config, name=name, gpus=gpu_list, restart=restart, queue=queue, notify=spec)
    if queue:
        from dflash_ops.runs import run_status

        info = run_status(containers[0], run_id)
        if info.effective_state == "queued":
            typer.echo(run_id)
            _hint(f"queued {run_id} on {targets[0]} at position {info.position}: waits for "
                  f"{'; '.join(info.waits_for)}; see the queue: dflash-ops run queue {targets[0]}")
            return
    _announce(run_id, "started", targets)


def _notify_spec(container: Container, urls: list[str]) -> dict[str, Any] | None:
    """What the container is told about who hears of this run (notify.py's spec), or None."""
    from dflash_ops.inventory import Notify, resolved_webhooks

    target = container.target
    wanted = getattr(target, "notify_all", None) or Notify()
    webhooks = resolved_webhooks(wanted, urls)
    if not webhooks and not wanted.commands:
        return None
    spec: dict[str, Any] = {"target": target.name, "webhooks": webhooks, "commands": [list(c) for c in wanted.commands]}
    if wanted.checkpoints:
        spec["checkpoints"] = True
    return spec


def _preflight(container: Container, config: Path, gpus: list[int] | None, force: bool) -> None:
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
        runs = list_runs(open_target(inventory, targets[0]))
        if as_json:
            _echo_json([r.raw for r in runs])
        elif not runs:
            _hint(f"no runs on {targets[0]} yet")
        else:
            _print_table(runs)
        return
    from dflash_ops.errors import TransportError
    from dflash_ops.fanout import map_by_node

    containers = [open_target(inventory, name) for name in targets]
    found: list[list[RunInfo] | Exception] = map_by_node(containers, list_runs, lambda c, e: e)
    failed = [(name, r) for name, r in zip(targets, found) if isinstance(r, Exception)]
    listed = [(name, r) for name, r in zip(targets, found) if not isinstance(r, Exception)]
    if as_json:
        doc: dict[str, object] = {name: [r.raw for r in runs] for name, runs in listed}
        doc.update({name: {"error": str(e)} for name, e in failed})
        _echo_json(doc)
    else:
        _print_table([info for _name, runs in listed for info in runs],
                     targets=[name for name, runs in listed for _info in runs])
        for name, runs in listed:
            if not runs:
                _hint(f"no runs on {name} yet")
    for name, error in failed:
        typer.echo(f"dflash-ops: error: {name}: {error}", err=True)
    if failed:
        raise typer.Exit(255 if any(isinstance(e, TransportError) for _n, e in failed) else 1)


def status(
    target: Target,
    run: OptionalRun = None,
    inventory: InventoryOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the helper's document as JSON.")] = False,
) -> None:
    """One run's state (default: the latest run); a failed run shows why and the tail of its log."""
    from dflash_ops.runs import resolve_run
    from dflash_ops.runs.group import group_of
    from dflash_ops.runs.report import status_detail

    info = resolve_run(open_target(inventory, target), run)
    if group_of(info) is not None:
        found, group = _members(inventory, target, info.run_id)
        if as_json:
            _echo_json({m.target: (m.info.raw if m.info else {"error": str(m.error)}) for m in found})
        else:
            _print_members(found, group or {})
        return
    if as_json:
        _echo_json(info.raw)
        return
    _print_table([info])
    for line in status_detail(info):
        typer.echo(line)  # status_detail escapes what came from the run directory


def _print_members(found: list[Member], group: dict[str, Any]) -> None:
    from dflash_ops.printable import printable_lines
    from dflash_ops.runs.report import status_detail

    shown = [(m, m.info) for m in found if m.info is not None]
    _print_table([info for _m, info in shown],
                 targets=[f"{m.target} (rank {m.rank if m.rank is not None else '?'})" for m, _info in shown])
    typer.echo(f"group: {len(found)} hosts, rendezvous {group.get('endpoint')}")
    for m in found:
        if m.info is None:
            typer.echo(f"{m.target}: cannot ask: {m.error}", err=True)
            continue
        for line in status_detail(m.info):
            if line.startswith("log tail"):
                break  # shown below, for the failed members
            typer.echo(f"{m.target}: {line.strip()}")  # a restart's line too: every member counts its own
    for m in found:
        if m.info is not None and m.info.effective_state == "failed" and m.info.log_tail:
            typer.echo(f"{m.target} log tail:")
            for line in printable_lines(m.info.log_tail)[-8:]:
                typer.echo("  " + line)


def queue_(
    target: Target,
    inventory: InventoryOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the helper's documents as JSON.")] = False,
) -> None:
    """The runs queued on TARGET, first in line first, and what each waits for."""
    from dflash_ops.runs import list_runs
    from dflash_ops.runs.lifecycle import expected_starts
    from trainer.run.contract import duration_text

    runs = list_runs(open_target(inventory, target))
    line = sorted((r for r in runs if r.effective_state == "queued"), key=lambda r: r.position or 0)
    starts = expected_starts(runs)
    if as_json:
        _echo_json([r.raw for r in line])
        return
    if not line:
        _hint(f"no runs queued on {target}")
        return
    for info in line:
        gpus = ",".join(map(str, info.gpus)) or "-"
        start = starts.get(info.run_id)
        expected = "not known yet (a run it waits for has no ETA)" if start is None else f"in {duration_text(start)}"
        typer.echo(f"{info.position}. {info.run_id} (gpus {gpus}, release {info.release or '-'}): "
                   f"waits for {'; '.join(info.waits_for) or 'nothing: starting'}; expected start {expected}")


def checkpoint(
    target: Target,
    run: Run,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the trainer has written it.")] = False,
    timeout: Timeout = 600.0,
    inventory: InventoryOption = None,
) -> None:
    """Ask a live run for a checkpoint at its next step boundary."""
    from dflash_ops.runs import checkpoint_run
    from dflash_ops.runs.group import checkpoint_group

    check_timeout(timeout)
    found = _group(inventory, target, run)
    if found is not None:
        w, request_id, path = checkpoint_group(found, run, wait=wait, timeout=timeout)
        if path is None:
            typer.echo(f"checkpoint requested on {w.target} (rank {w.rank}, the writer) ({request_id}); wait with --wait")
        else:
            typer.echo(f"checkpoint {path} written on {w.target} (request {request_id})")
        return
    request_id, path = checkpoint_run(open_target(inventory, target), run, wait=wait, timeout=timeout)
    if path is None:
        typer.echo(f"checkpoint requested ({request_id}); wait for it with --wait")
    else:
        typer.echo(f"checkpoint {path} written (request {request_id})")


class _StopWaiter:
    """Says on stderr what `run stop` waits for: at once, on every change of state or phase, and
    every WAIT_REPEAT_S while nothing changes (a stop is never silent)."""

    WAIT_REPEAT_S = 15.0

    def __init__(self, run_id: str) -> None:
        self.run_id, self.said, self.when = run_id, "", 0.0

    def __call__(self, info: RunInfo) -> None:
        from dflash_ops.runs.lifecycle import waiting_for

        text = waiting_for(info)
        key = f"{info.effective_state} {(info.phase or {}).get('name')} {info.final}"  # a count moving is not news
        if key != self.said or time.monotonic() - self.when >= self.WAIT_REPEAT_S:
            _hint(f"waiting for {self.run_id} to stop: {text}")
            self.said, self.when = key, time.monotonic()


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
    from dflash_ops.runs.group import stop_group
    from trainer.run.contract import phase_text

    if now and kill:
        fail("--now and --kill exclude each other", 2)
    check_timeout(timeout)
    found = _group(inventory, target, run)
    if found is not None:
        waiters = {m.target: _StopWaiter(f"{run} on {m.target}") for m in found}
        infos = stop_group(found, run, now=now, kill=kill, wait=not no_wait, timeout=timeout,
                           on_wait=lambda m, info: waiters[m.target](info))
        prefixes = [f"{m.target}: " for m in found]
    else:
        infos = [stop_run(open_target(inventory, target), run, now=now, kill=kill, wait=not no_wait, timeout=timeout,
                          on_wait=_StopWaiter(run))]
        prefixes = [""]
    for prefix, info in zip(prefixes, infos):
        phase = phase_text(info.phase)
        where = f" (while {phase})" if phase and (info.phase or {}).get("name") != "finished" else ""
        typer.echo(f"{prefix}{_at_step(info)}{where}; last checkpoint {info.last_checkpoint or 'none'}")
    if any(info.effective_state == "failed" for info in infos) and not kill:
        raise typer.Exit(1)


def resume(
    target: Target,
    run: Run,
    from_step: Annotated[Optional[int], typer.Option("--from", help="Checkpoint step to resume from (default: latest).")] = None,
    gpus: Gpus = None,
    config: Annotated[Optional[Path], typer.Option("--config", help="A new trainer config for the rest of the run (default: the run's own).")] = None,
    restart: Restart = None,
    inventory: InventoryOption = None,
) -> None:
    """Restart a stopped (or failed) run from its checkpoint on the current release; the step count continues."""
    from dflash_ops.runs import resume_run, start_run
    from dflash_ops.runs.group import resume_group
    from dflash_ops.runs.lifecycle import check_restart

    if config is not None and not config.is_file():
        fail(f"--config {config}: no such file", 2)
    found = _group(inventory, target, run)
    if found is not None:
        if config is not None:
            fail("--config: a run across hosts resumes on its own config (edit each member's "
                 "runs/RUN/config.input.yaml to change it)", 2)
        check_restart(restart)
        resume_group(found, run, from_step=from_step, gpus=parse_gpus(gpus), restart=restart)
        typer.echo(run)
        _hint(f"resumed {run} on {' '.join(m.target for m in found)}; see it: dflash-ops run status {found[0].target} {run}")
        return
    container = open_target(inventory, target)
    if config is None:
        run_id = resume_run(container, run, from_step=from_step, gpus=parse_gpus(gpus), restart=restart)
    else:
        run_id = start_run(container, config, resume="latest" if from_step is None else from_step,
                           gpus=parse_gpus(gpus), run_id=run, restart=restart)
    _announce(run_id, "resumed", [target])


def logs(
    target: Target,
    run: OptionalRun = None,
    follow: Follow = False,
    lines: Annotated[Optional[int], typer.Option("-n", "--lines", min=0, help="Start with the last N lines (default: all).")] = None,
    rank: Annotated[Optional[int], typer.Option("--rank", min=0, help="A run across hosts: the log of this rank (default: TARGET's).")] = None,
    inventory: InventoryOption = None,
) -> None:
    """Print a run's train.log, byte for byte; with -f follow it, resuming after a dropped connection."""
    if rank is not None:
        from dflash_ops.runs import resolve_run
        from dflash_ops.runs.group import wait_for_rank

        run = run if run is not None else resolve_run(open_target(inventory, target), None).run_id
        found, group = _members(inventory, target, run)
        if group is not None:
            asked = [found]  # the first look is the one just made

            def look() -> list[Member]:
                return asked.pop() if asked else _members(inventory, target, run)[0]

            def waiting(text: str) -> None:
                typer.echo(text, err=True)

            target = wait_for_rank(look, rank, on_wait=waiting).target
        elif rank != 0:
            fail(f"run {run} on {target} runs on one host: it has rank 0 only", 2)
    _follow_cli(target, run, "train.log", follow, lines, inventory, write_stdout)


def metrics(
    target: Target,
    run: OptionalRun = None,
    follow: Follow = False,
    lines: Annotated[Optional[int], typer.Option("-n", "--lines", min=0, help="Start with the last N events (default: all).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The raw JSON lines of metrics.jsonl.")] = False,
    output_format: Annotated[str, typer.Option(
        "--format", help="text (a line per event), json (as --json) or prometheus: the target's runs, GPUs and "
                         "queue now, in Prometheus's text exposition format (RUN, -f and -n do not apply)")] = "text",
    inventory: InventoryOption = None,
) -> None:
    """A compact line per metrics event (step: loss, acc, lr, grad norm, tokens/s; eval: tau)."""
    if output_format not in ("text", "json", "prometheus"):
        fail(f"--format {output_format!r}: one of text, json, prometheus", 2)
    if output_format == "prometheus":
        from dflash_ops.runs.prometheus import exposition, scrape_target

        if run is not None or follow or lines is not None:
            fail("--format prometheus shows the target's runs now: no RUN, -f or -n", 2)
        scrape = scrape_target(target, lambda: open_target(inventory, target))
        if scrape.error is not None:
            fail(f"{target}: {scrape.error}", 1)
        typer.echo(exposition([scrape]), nl=False)
        return
    as_json = as_json or output_format == "json"
    on_line = write_stdout if as_json else _MetricPrinter().line
    _follow_cli(target, run, "metrics.jsonl", follow, lines, inventory, on_line)


class _MetricPrinter:
    def __init__(self) -> None:
        self.total_steps: int | None = None

    def line(self, raw: bytes) -> None:
        from dflash_ops.runs.events import BadLine, parse_event
        from dflash_ops.runs.report import metric_line

        event = parse_event(raw)
        if isinstance(event, BadLine):
            write_stdout((event.describe() + "\n").encode())
            return
        if event.get("event") == "start":
            self.total_steps = event.get("total_steps")
        write_stdout((metric_line(event, self.total_steps) + "\n").encode())


def _follow_cli(target: str, run: str | None, name: str, follow: bool, lines: int | None, inventory: Path | None,
                on_line: Callable[[bytes], None]) -> None:
    from dflash_ops.runs import FollowCallbacks, RunNotFound, follow_file, resolve_run, run_status

    container = open_target(inventory, target)
    watcher = None
    try:
        run_id = run if run is not None else resolve_run(container, None).run_id
        if follow:
            watcher = _StateWatcher(container, run_id)
        try:
            callbacks = FollowCallbacks(
                on_line=on_line,
                on_retry=lambda error, delay: _hint(f"dflash-ops: {error}; retrying in {delay:.1f}s"),
                on_truncated=lambda reached, size: _hint(
                    f"dflash-ops: warning: {name} of {run_id} was truncated or replaced at byte {reached} "
                    f"(now {size} bytes); what was written before that and not yet shown is lost; "
                    "following from its start"))
            follow_file(container, run_id, name, callbacks, tail_lines=lines, follow=follow)
        except RunNotFound:
            info = run_status(container, run_id)  # no such run: raises, and says so
            # the run exists, its file not yet: a healthy run writes metrics.jsonl once its model loaded
            _hint(f"dflash-ops: run {run_id} ({info.effective_state}) has not written {name} yet"
                  + ("" if info.final else "; it starts with the first step (or follow it with -f)"))
            if info.effective_state == "failed":
                raise typer.Exit(1) from None
            return
        if not follow:
            return
        info = run_status(container, run_id)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    finally:
        if watcher is not None:
            watcher.close()
    _hint(_at_step(info))
    if info.effective_state == "failed":
        raise typer.Exit(1)


class _StateWatcher:
    """While `logs -f` / `metrics -f` follows a run, the inventory's `notify: local:` commands run
    on its state changes (dflash_ops.runs.local_notify): a thread asks its status every POLL_S.
    Plain thread, not asyncio: the follow itself blocks this process' main thread."""

    POLL_S = 2.0

    def __init__(self, container: Container, run_id: str) -> None:
        import threading

        from dflash_ops.cli.dash import local_notifier

        self.container, self.run_id = container, run_id
        self.notifier = local_notifier(container.target, _hint)  # type: ignore[arg-type]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True, name=f"notify-watch-{run_id}")
        if self.notifier is not None:
            self.thread.start()

    def _watch(self) -> None:
        from dflash_ops.errors import DflashOpsError
        from dflash_ops.runs import run_status

        assert self.notifier is not None
        while True:
            try:
                self.notifier.see(run_status(self.container, self.run_id))
            except DflashOpsError:
                pass  # a dropped connection: the follow says so; look again next time
            if self.stop.wait(self.POLL_S):
                return

    def close(self) -> None:
        """One last look (the final state), then the commands started are let finish."""
        if self.notifier is None:
            return
        self.stop.set()
        self.thread.join()
        from dflash_ops.errors import DflashOpsError
        from dflash_ops.runs import run_status

        try:
            self.notifier.see(run_status(self.container, self.run_id))
        except DflashOpsError:
            pass
        self.notifier.wait()


def pull(
    target: Target,
    run: Run,
    dest: Annotated[Path, typer.Argument(help="Local directory; the checkpoint lands in DEST/step_N.")],
    checkpoint_: Annotated[str, typer.Option("--checkpoint", help="'latest' or a step number.")] = "latest",
    inventory: InventoryOption = None,
) -> None:
    """Copy a checkpoint out, each file verified against its manifest; a second pull resumes. The run's
    tracker files (TensorBoard event files, an MLflow file store) come along into DEST/tensorboard and
    DEST/mlruns."""
    from dflash_ops.runs import pull_checkpoint
    from dflash_ops.runs.group import pull_group
    from dflash_ops.runs.pull import pull_tracker_files

    if checkpoint_ != "latest" and not checkpoint_.isdigit():
        fail(f"--checkpoint {checkpoint_!r}: expected 'latest' or a step number", 2)
    found = _group(inventory, target, run)
    if found is not None:
        member, local = pull_group(found, run, checkpoint_, dest)
        typer.echo(f"from {member.target}:", err=True)
        trackers = pull_tracker_files(member.container, run, dest)
    else:
        container = open_target(inventory, target)
        local = pull_checkpoint(container, run, checkpoint_, dest)
        trackers = pull_tracker_files(container, run, dest)
    manifest = json.loads((local / "manifest.json").read_text())
    size = sum(f["size"] for f in manifest["files"].values())
    typer.echo(f"{local}: {len(manifest['files'])} files, {size / 1e6:.1f} MB, sha256 verified")
    for path in trackers:
        typer.echo(f"{path}: the run's {path.name} files")


def _members(inventory: Path | None, target: str, run_id: str) -> tuple[list[Member], dict[str, Any] | None]:
    """Every member of the run (dflash_ops.runs.group.members), with the inventory loaded once."""
    from dflash_ops.connect import open_container
    from dflash_ops.inventory import load_inventory
    from dflash_ops.runs.group import members

    loaded = load_inventory(inventory)
    return members(lambda name: open_container(loaded, name), target, run_id)


def _group(inventory: Path | None, target: str, run: str) -> list[Member] | None:
    """The members of `run` when it is a run across hosts, else None (also when the run cannot
    be found: the one-host command then reports that, after its own checks of its arguments)."""
    from dflash_ops.runs.info import RunError

    try:
        found, group = _members(inventory, target, run)
    except RunError:
        return None
    return found if group is not None else None


def register(app: typer.Typer) -> None:
    run_app.command("start")(start)
    run_app.command("list")(list_)
    run_app.command("status")(status)
    run_app.command("queue")(queue_)
    run_app.command("checkpoint")(checkpoint)
    run_app.command("stop")(stop)
    run_app.command("resume")(resume)
    app.add_typer(run_app, name="run")
    app.command("logs")(logs)
    app.command("metrics")(metrics)
    app.command("pull")(pull)
