"""One run over several targets (one container per node): torchrun ranks with one run id.

`start_group` finds each container's address (the inventory's `address` for the target, else
asked from the container: the source address of its route toward the first member's node),
picks the rendezvous endpoint (the first member's address and a port free there now), and
starts every rank detached through the `runs` helper; each member's run directory then holds
group.json {"targets", "index", "nnodes", "endpoint"}. Every other operation reads group.json
from the member it is given and acts on all members: status, stop, resume, checkpoint (sent to
the writer: the rank that writes checkpoints), logs of a rank, pull (from the member holding the
checkpoint). docs/multi-node.md.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_ops.fanout import map_by_node
from dflash_ops.runs.helper import call_json, check_run_id
from dflash_ops.runs.info import RunError, RunInfo, RunNotFound, RunRefused
from dflash_ops.runs.lifecycle import (
    _start,
    ask_to_stop,
    check_restart,
    launch_fresh,
    request_checkpoint,
    run_status,
    signal_run,
    wait_until_final,
)
from dflash_ops.runs.pull import find_checkpoint, pull_checkpoint

if TYPE_CHECKING:
    from dflash_ops.container import ContainerAPI

Opener = Callable[[str], "ContainerAPI"]  # target name -> Container


@dataclass
class Member:
    target: str
    container: ContainerAPI
    info: RunInfo | None = None  # None when it could not be asked (error holds why)
    error: Exception | None = None

    @property
    def rank(self) -> int | None:
        d = (self.info.raw.get("distributed") if self.info else None) or {}
        return d.get("rank")

    @property
    def writer(self) -> bool:
        d = (self.info.raw.get("distributed") if self.info else None) or {}
        return bool(d.get("writer"))


def group_of(info: RunInfo) -> dict[str, Any] | None:
    """group.json of a member's run, or None for a one-host run."""
    group = info.raw.get("group")
    return group if isinstance(group, dict) and isinstance(group.get("targets"), list) else None


# ---------------------------------------------------------------------------- starting

def container_address(container: ContainerAPI, toward: str | None) -> str:
    address = getattr(container.target, "address", None)
    if address:
        return address
    args = ["address"] + (["--toward", toward] if toward else [])
    return call_json(container, args)["address"]


def _node_address(container: ContainerAPI) -> str | None:
    return getattr(container.target.node, "address", None)


def _launch(containers: Sequence[ContainerAPI], run_id: str, extra: list[str], stdin: bytes | None, names: list[str],
            gpus: list[int] | None, notify: dict | None = None) -> None:
    """Start every rank; if one cannot start, stop the ones already started (they wait for it).
    `notify` (a notify spec) goes to the first member, which tells the group's events; with
    "checkpoints" to every member (a checkpoint is told where it is written: the writer's host)."""
    toward = _node_address(containers[1]) if len(containers) > 1 else None
    addresses = [container_address(c, _node_address(containers[0]) if i else toward) for i, c in enumerate(containers)]
    port = call_json(containers[0], ["free-port", "--address", addresses[0]])["port"]
    endpoint = f"{addresses[0]}:{port}"
    started: list[ContainerAPI] = []
    try:
        for i, c in enumerate(containers):
            group = {"targets": names, "index": i, "nnodes": len(containers), "endpoint": endpoint}
            args = [*extra, "--group", json.dumps(group, sort_keys=True), "--nnodes", str(len(containers)),
                    "--rdzv-endpoint", endpoint, "--local-addr", addresses[i]]
            args += ["--store-host"] if i == 0 else []
            sent = stdin
            if (i == 0 or (notify or {}).get("checkpoints")) and notify and (notify.get("webhooks") or notify.get("commands")):
                args.append("--notify-stdin")  # the spec's line, then the config: a webhook URL is never an argument
                sent = json.dumps(notify, sort_keys=True).encode() + b"\n" + (stdin or b"")
            _start(c, run_id, args, sent, gpus)
            started.append(c)
    except BaseException:
        for c in started:
            try:
                signal_run(c, run_id, "TERM")
            except Exception:  # noqa: BLE001 - best effort; the rank also gives up at its join timeout
                pass
        raise


def check_members(names: list[str]) -> None:
    if len(names) < 2:
        raise RunError("a run across hosts needs at least two targets")
    if len(set(names)) != len(names):
        raise RunError(f"targets {names}: a target is named twice (one rank per container)")


def check_micro_batches(config: bytes, hosts: int, source: str) -> None:
    """optim.micro_batches is the global count per step: every host must get the same share.
    (The trainer refuses it too; here the user hears it before anything starts.)"""
    import yaml

    from trainer.run.yamlsafe import safe_load

    try:
        doc = safe_load(config.decode("utf-8", "replace")) or {}
    except yaml.YAMLError:
        return  # the trainer reports the YAML error with its line
    optim = doc.get("optim") if isinstance(doc, dict) else None
    micro = optim.get("micro_batches", 1) if isinstance(optim, dict) else 1
    if isinstance(micro, int) and micro % hosts:
        raise RunError(f"{source}: optim.micro_batches is {micro}, not a multiple of the {hosts} hosts: it counts the "
                       f"micro-batches of a step over all hosts (e.g. micro_batches: {hosts * max(1, micro // hosts)})")


def start_group(containers: Sequence[ContainerAPI], names: list[str], config_path_local: Path | str, name: str | None = None,
                gpus: list[int] | None = None, restart: str | None = None, notify: dict | None = None) -> str:
    """Start one run over `containers` (targets `names`, in rank-hint order); returns the run id.

    `restart` ("on-failure:N"): every member's rank runs under a supervisor in its container; after
    a rank dies (which stops them all) each restarts its rank and the ranks resume together from
    the newest complete checkpoint of the group, at most N times (docs/multi-node.md). `notify`:
    who hears of the group's state changes (told by the first member)."""
    check_members(names)
    config = Path(config_path_local).read_bytes()
    check_micro_batches(config, len(names), str(config_path_local))
    extra = ["--config", "-", *check_restart(restart)]

    def launch(run_id: str) -> str:
        _launch(containers, run_id, extra, config, names, gpus, notify)
        return run_id

    return launch_fresh(name, launch, " on a member; pass --name")


# ---------------------------------------------------------------------------- the members

def members(open_target: Opener, target: str, run_id: str) -> tuple[list[Member], dict[str, Any] | None]:
    """Every member of the run `run_id` seen from `target`, asked in parallel (one connection per
    node); a one-host run gives [that target] and group None."""
    first = open_target(target)
    info = run_status(first, check_run_id(run_id))
    group = group_of(info)
    if group is None:
        return [Member(target, first, info)], None
    names = [str(n) for n in group["targets"]]
    if target not in names:
        raise RunError(f"run {run_id} on {target} names targets {names} but not {target}: its group.json is "
                       "from another inventory")
    containers = [first if n == target else open_target(n) for n in names]
    found: list[RunInfo | Exception] = map_by_node(
        containers, lambda c: info if c is first else run_status(c, run_id), lambda c, e: e)
    return [Member(n, c, None, r) if isinstance(r, Exception) else Member(n, c, r)
            for n, c, r in zip(names, containers, found)], group


def member_of_rank(group_members: list[Member], rank: int) -> Member:
    for m in group_members:
        if m.rank == rank:
            return m
    known = ", ".join(f"{m.target}: {m.rank if m.rank is not None else '?'}" for m in group_members)
    raise RunNotFound(f"no member with rank {rank} ({known}); ranks are known once the ranks joined")


RANK_WAIT_S = 120.0  # how long `logs --rank N` waits for the ranks to join after a start


def wait_for_rank(look: Callable[[], list[Member]], rank: int, timeout: float = RANK_WAIT_S, poll: float = 1.0,
                  on_wait: Callable[[str], None] | None = None) -> Member:
    """The member of `rank`, asking `look` (the members as they are now) again while the ranks have
    not joined yet: right after a start no member knows its rank for a moment. RunNotFound at
    once for a rank the group cannot have or once every member is final; after `timeout` seconds
    of waiting too. on_wait(text) once, when it waits."""
    deadline = time.monotonic() + timeout
    said = False
    while True:
        found = look()
        try:
            return member_of_rank(found, rank)
        except RunNotFound:
            if rank >= len(found) or all(m.info is not None and m.info.final for m in found) \
                    or time.monotonic() >= deadline:
                raise
        if not said and on_wait is not None:
            on_wait(f"waiting for rank {rank}: the ranks are known once they joined (up to {timeout:.0f}s)")
            said = True
        time.sleep(poll)


def writer(group_members: list[Member]) -> Member:
    return next((m for m in group_members if m.writer), None) or member_of_rank(group_members, 0)


def _asked(group_members: list[Member]) -> list[tuple[Member, RunInfo]]:
    """Every member with its status; a member that could not be asked is an error."""
    lost = [f"{m.target}: {m.error}" for m in group_members if m.info is None]
    if lost:
        raise RunError("cannot reach every member: " + "; ".join(lost))
    return [(m, m.info) for m in group_members if m.info is not None]


def stop_group(group_members: list[Member], run_id: str, now: bool = False, kill: bool = False,
               wait: bool = True, timeout: float = 600.0, poll: float = 1.0,
               on_wait: Callable[[Member, RunInfo], None] | None = None) -> list[RunInfo]:
    """A stop request (or TERM/KILL) to every live member; the ranks agree to stop at one step."""
    for m, info in _asked(group_members):
        if info.alive or not info.final:
            ask_to_stop(m.container, run_id, info, now=now, kill=kill)
    if not wait:
        return [run_status(m.container, run_id) for m in group_members]
    return [wait_until_final(m.container, run_id, timeout=timeout, poll=poll,
                             on_wait=None if on_wait is None else partial(on_wait, m)) for m in group_members]


def checkpoint_group(group_members: list[Member], run_id: str, wait: bool = False, timeout: float = 600.0,
                     poll: float = 1.0) -> tuple[Member, str, str | None]:
    """Ask the writer for a checkpoint: (writer, request id, path when waited for)."""
    w = writer(group_members)
    if w.info is None or w.info.final:
        state = w.info.effective_state if w.info else f"unreachable ({w.error})"
        raise RunError(f"run {run_id} is {state} on {w.target}; only a live run can checkpoint")
    return (w, *request_checkpoint(w.container, run_id, wait, timeout, poll))


def resume_group(group_members: list[Member], run_id: str, from_step: int | None = None,
                 gpus: list[int] | None = None, restart: str | None = None) -> None:
    """Restart every member from the newest checkpoint any of them holds (or step `from_step`),
    with a fresh rendezvous endpoint. `restart` defaults to the run's own policy (its first
    member's restarts.json)."""
    asked = _asked(group_members)
    running = [m.target for m, info in asked if info.alive]
    if running:
        raise RunRefused(f"run {run_id} still runs on {', '.join(running)}: stop it first (`run stop`)")
    held = sorted({s for _m, info in asked for s in info.checkpoints})
    if not held:
        raise RunError(f"run {run_id} has no complete checkpoint on any member: nothing to resume from")
    if from_step is None and all(info.effective_state == "done" for _m, info in asked):
        raise RunRefused(f"run {run_id} is done: nothing to resume (pass --from STEP)")
    if from_step is not None and from_step not in held:
        raise RunNotFound(f"no member of run {run_id} holds checkpoint step_{from_step} (held: {held})")
    policy = restart if restart is not None else asked[0][1].restart_policy
    extra = ["--resume", "latest" if from_step is None else str(from_step), *check_restart(policy)]
    _launch([m.container for m in group_members], run_id, extra, None, [m.target for m in group_members], gpus)


def pull_group(group_members: list[Member], run_id: str, step: int | str, dest: Path | str) -> tuple[Member, Path]:
    """Pull the checkpoint from the member holding it (for 'latest': the newest on any member)."""
    holders: list[tuple[int, Member]] = []
    for m in group_members:
        if m.info is None:
            continue
        try:
            holders.append((find_checkpoint(m.container, run_id, step)["step"], m))
        except RunNotFound:
            continue
    if not holders:
        raise RunNotFound(f"no member of run {run_id} holds {'a complete checkpoint' if step == 'latest' else f'checkpoint step_{step}'}")
    found_step, m = max(holders, key=lambda h: h[0])
    return m, pull_checkpoint(m.container, run_id, found_step, dest)
