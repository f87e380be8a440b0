"""`deploy`: make a container's code, helpers and venv exact, versioned and fast to refresh.

One deploy of one target is at most:
  1. `release_store.py query`   what the container holds (current release manifest, venv, helpers);
  2. `venv.py ensure`     only when the venv for this lock hash is missing;
  3. `release_store.py apply`   one tar stream with only the new/changed files (+ missing helpers),
                          finalized inside the container: link unchanged files from the
                          current release, verify all sha256, rename, swap `current`, prune.
Nothing is sent when the release already exists and `current` points at it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from dflash_ops import render
from dflash_ops.deploy.manifest import changed_files, collect, release_tar, trainer_dir
from dflash_ops.deploy.venv_spec import VenvSpec
from dflash_ops.errors import HelperFailed
from dflash_ops.helpers import bundle, helper_names, source_of, venvs
from dflash_ops.tarstream import ProgressReader, stream_size

if TYPE_CHECKING:
    from dflash_ops.container import ContainerAPI
    from dflash_ops.inventory import Target

DEFAULT_KEEP = 5

ProgressCallback = Callable[[str, int, int], None]  # (phase, bytes_done_increment, total)


@dataclass
class DeploySummary:
    target: str
    release: str | None = None
    previous: str | None = None
    action: str = ""  # "none" (already current), "switch", "build", or "" when failed early
    files_total: int = 0
    files_sent: int = 0
    bytes_sent: int = 0
    helpers_sent: int = 0
    venv: str | None = None  # venvs/<lock-hash>
    venv_action: str | None = None  # "reused", "built", "built-pip"
    pruned: list[str] = field(default_factory=list)
    seconds: float = 0.0
    pct_calls: int = 0
    dry_run: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def helper_files(container: ContainerAPI) -> list[tuple[str, Path]]:
    """Every file of every helper's bundle as (`helpers/<bundle hash>/<file>` relative to base_dir,
    local path): a helper and the shared modules shipped beside it (dflash_ops/helpers/__init__.py)."""
    found = []
    for name in helper_names():
        one = bundle(name)
        found += [(one.rel(filename), source_of(filename)) for filename, _content in one.files]
    return found


def _commands_run(container: ContainerAPI) -> int:
    transport = getattr(container, "transport", None)
    return int(getattr(transport, "commands_run", 0))


def deploy_target(
    container: ContainerAPI,
    *,
    extra_paths: Iterable[str | Path] = (),
    venv: VenvSpec | None = VenvSpec(),
    keep: int = DEFAULT_KEEP,
    dry_run: bool = False,
    source: Path | None = None,
    on_progress: ProgressCallback | None = None,
) -> DeploySummary:
    """Deploy the trainer (or `source`, a package dir) plus `extra_paths` into `container`.

    `venv=None` deploys without a venv (runs use the target's python). Raises HelperFailed (a step
    failed in the container) or a transport error; the container's `current` release is untouched by any failure.
    """
    started = time.monotonic()
    calls_before = _commands_run(container)
    base = container.base_dir
    summary = DeploySummary(target=container.target.name, dry_run=dry_run)
    venv_rel = venv.rel_path() if venv else None
    release = collect(extra_paths, source=source, venv=venv_rel)
    helpers = helper_files(container)
    summary.release, summary.venv, summary.files_total = release.hash, venv_rel, len(release.files)

    query = ["query", base, "--release", release.hash]
    query += ["--venv", venv_rel] if venv_rel else []
    for rel, _path in helpers:
        query += ["--helper", rel]
    state = container.helper_json("release-store", query)
    summary.previous = state["current"]

    present = set(state["helpers_present"])
    missing_helpers = [(rel, path) for rel, path in helpers if rel not in present]
    if state["has_release"]:
        to_send: list[str] = []
        summary.action = "none" if state["current"] == release.hash else "switch"
    else:
        to_send = changed_files(release, state["current_files"])
        summary.action = "build"
    summary.files_sent = len(to_send)
    summary.helpers_sent = len({rel.split("/")[1] for rel, _path in missing_helpers})
    summary.venv_action = None if venv is None else ("reused" if state["venv_ready"] else "build")

    if dry_run:
        summary.bytes_sent = release.size(to_send) + sum(p.stat().st_size for _r, p in missing_helpers)
        return _finish(summary, container, started, calls_before)

    if venv is not None and not state["venv_ready"]:
        with venv.tar() as stream:
            summary.bytes_sent += stream_size(stream)
            try:
                built = container.helper_json("venv", venv.helper_args(base), stdin=stream)
            except HelperFailed as e:
                raise _no_pip(container, e) from None
        summary.venv_action = "built-pip" if built.get("pip") else "built"

    if summary.action == "build" or missing_helpers:
        parent_manifest = state["current_files"] if summary.action == "build" and state["current"] else None
        with release_tar(release, to_send, missing_helpers, parent_manifest) as tar:
            total = stream_size(tar)
            reader = tar if on_progress is None else ProgressReader(tar, lambda n: on_progress("send", n, total))
            args = ["apply", base, release.hash, "--keep", str(keep)]
            if state["current"] and summary.action == "build":
                args += ["--parent", state["current"]]
            done = container.helper_json("release-store", args, stdin=reader)
            summary.bytes_sent += total
        summary.pruned = done.get("pruned", [])
    elif summary.action == "switch":
        summary.pruned = container.helper_json("release-store", ["switch", base, release.hash, "--keep", str(keep)])["pruned"]
    return _finish(summary, container, started, calls_before)


def _no_pip(container: ContainerAPI, error: HelperFailed) -> HelperFailed:
    """The venv helper's "no pip" answer with the one command that fixes it on this target."""
    if not error.document.get("no_pip"):
        return error
    target = container.target
    install = [str(a) for a in error.document.get("fix_argv") or venvs.NO_PIP_FIX_ARGV]
    fix = render.node_command(install)
    if target.node.pct:
        fix = f"on node {target.node.name}: {render.node_command(['pct', 'exec', str(target.ctid), '--', *install])}"
    document = dict(error.document, error=f"{str(error.document['error']).split('; fix:')[0]}; fix: {fix}", fix=fix)
    return HelperFailed(error.helper, ["ensure"], error.exit_code, error.stderr, "", document)


def _finish(summary: DeploySummary, container: ContainerAPI, started: float, calls_before: int) -> DeploySummary:
    summary.seconds = round(time.monotonic() - started, 3)
    summary.pct_calls = _commands_run(container) - calls_before
    return summary


def target_options(target: Target, *, extra_paths: Iterable[str | Path] = (), keep: int | None = None,
                   no_venv: bool = False) -> dict[str, Any]:
    """deploy_target keyword arguments for an inventory target.

    Reads the target's optional `extra_paths`, `venv` (a mapping, or false for none) and
    `keep_releases` when the inventory provides them; relative paths resolve against the
    project root (the directory holding `trainer/`). Explicit arguments add to / override them.
    """
    root = trainer_dir().parent
    paths = [Path(p) if Path(p).is_absolute() else root / p for p in target.extra_paths]
    venv_config = target.venv_config
    venv = None if no_venv or venv_config is False else VenvSpec.from_config(venv_config if isinstance(venv_config, dict) else {}, base=root)
    keep = keep or target.keep_releases or DEFAULT_KEEP
    return {"extra_paths": [*paths, *extra_paths], "venv": venv, "keep": keep}


def deploy_many(
    names: Sequence[str],
    open_container: Callable[[str], Any],
    deploy: Callable[[Any, str], DeploySummary],
) -> list[DeploySummary]:
    """Deploy every target in parallel, by node (dflash_ops.fanout: one connection per node);
    a failing target never stops the others, a dead node costs one connect timeout.

    `open_container(name)` gives the target's Container, `deploy(container, name)` runs the
    deploy; a raised error becomes that target's summary.error.
    """
    from dflash_ops.fanout import map_targets

    def failed(name: str, e: Exception, seconds: float) -> DeploySummary:
        return DeploySummary(target=name, error=f"{type(e).__name__}: {e}", seconds=round(seconds, 3))

    return map_targets(names, open_container, deploy, failed)
