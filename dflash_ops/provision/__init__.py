"""`dflash-ops provision`: from a node to a GPU container that passes doctor (docs/provision.md).

One function, `provision`, creates the container when it does not exist (`pct create`), or repairs
it: the GPUs as devN entries (PVE 8.1+) or bind mounts with cgroup allow rules, `/dev/shm` as a
tmpfs mount entry, memlock/nofile limits, then starts it, makes sure its python can build venvs and
installs the NVIDIA user-space libraries of exactly the node's kernel-module version. `doctor --fix`
calls the same function on an existing container. Every node command is an argv rendered by
render.py; `dry_run` prints each (as `exec --print-command` does) and the config diff and runs only
the reads. Options go through `pct set`; the lxc.* lines it appends are recorded as its own
(config.py says why in a sidecar file) and it never removes or rewrites a line it did not write.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from dflash_ops import render
from dflash_ops.doctor.node import node_facts
from dflash_ops.errors import DflashOpsError
from dflash_ops.provision import bootunit, driverpkgs, userspace
from dflash_ops.provision.config import (
    ID_BASE,
    ID_RANGE,
    DeviceAccess,
    RawConfig,
    config_diff,
    gpu_device_paths,
    idmap_lines,
    owned_path,
    parse_owned,
    plan_lxc,
    render_owned,
    subid_missing,
    wanted_devn,
    wanted_lxc,
)
from dflash_ops.provision.node import NodeInfo, ProvisionError, node_commands, read_node
from dflash_ops.provision.session import Confirm, Outcome, Say, _Session, node_rendered

if TYPE_CHECKING:
    from dflash_ops.container import Container
    from dflash_ops.inventory import Target

__all__ = ["Outcome", "ProvisionError", "Request", "provision"]

# Replaces the config file with stdin only while it is still what was read (its sha256 is $1): run
# under flock(1) on pct's own config lock, so no pct command writes it meanwhile.
_REPLACE = ('f="$2"; [ "$(sha256sum < "$f" | cut -d " " -f 1)" = "$1" ] || '
            '{ echo "dflash-ops: $f changed since it was read; nothing written" >&2; exit 3; }; '
            'cat > "$f.dflash-ops.tmp" && mv "$f.dflash-ops.tmp" "$f"')
_WRITE = 'mkdir -p "${1%/*}" && cat > "$1.tmp" && mv "$1.tmp" "$1"'
_READ = 'for f; do echo "--- dflash-ops $f"; cat "$f" 2>/dev/null; done; exit 0'
LOCK_WAIT_S = 10  # pct's own wait for the config lock (AbstractConfig lock_config)


@dataclass(frozen=True, kw_only=True)
class Request:
    gpus: Literal["all"] | tuple[int, ...] = ()
    cores: int | None = None
    memory_mib: int | None = None
    rootfs: str | None = None  # STORAGE:GiB, for pct create
    shm_gib: int | None = None  # default: 1 GiB, 512 MiB per GPU from two GPUs on (docs/doctor.md)
    template: str | None = None
    unprivileged: bool = True
    device: DeviceAccess = DeviceAccess()  # uid/gid/mode on every devN entry (a non-root user's GPUs)
    features: str | None = None  # pct's features: (e.g. nesting=1)
    # the node's unit that makes the NVIDIA device nodes at boot (bootunit.py): "install" (a no stops
    # provision), "offer" (doctor --fix: a no leaves it out, noted), "" (not asked)
    boot_unit: Literal["", "install", "offer"] = ""
    create: bool = True  # doctor --fix repairs; it never creates

    def __post_init__(self) -> None:
        """Ranges where the values enter (the CLI checks them too): `--shm -1` wrote size=-1G into
        a running container's config, which then did not start again (issue 55)."""
        for name, value, low in (("shm_gib", self.shm_gib, 1), ("cores", self.cores, 1), ("memory_mib", self.memory_mib, 16)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{name} must be an integer of at least {low}, got {value!r}")


def default_shm_gib(gpus: tuple[int, ...]) -> int:
    return max(1, math.ceil(len(gpus) / 2))


def provision(container: Container, request: Request, *, dry_run: bool = False, yes: bool = False,
              confirm: Confirm = lambda question: False, say: Say = print) -> Outcome:
    """Take the target's container to the asked state; returns what changed (nothing on a rerun)."""
    target = container.target
    if not target.node.pct:
        raise ProvisionError(f"{target.name}: node {target.node.name} has no pct (`pct: none`): nothing to provision")
    s = _Session(container, dry_run, say)
    kind = target.node.kind
    for argv in node_commands(kind):
        if argv[0] != "echo":  # a section marker of the round trip
            s.show("the node's PVE version, NVIDIA module and driver packages (read)", node_rendered(argv))
    node = read_node(target.node.name, kind, container.transport)
    if request.gpus and node.module and node.packages.installed:  # refused before anything changes
        driverpkgs.plan(node, target, kind.container_root(target.ctid))
    if request.boot_unit:  # asked first: a "no" changes nothing anywhere
        bootunit.ensure(s, target, yes, confirm, required=request.boot_unit == "install")
    gpus = _resolve_gpus(request.gpus, node, target)
    s.outcome.gpus = gpus
    state = node_facts(target, container.transport).state
    if state in ("unreachable", "unknown"):
        raise ProvisionError(f"{target.name}: node {target.node.name} did not answer `pct status {target.ctid}`")
    pct = target.node.pct
    if state == "missing":
        if not request.create:
            raise ProvisionError(f"container {target.ctid} does not exist on node {target.node.name}: "
                                 f"dflash-ops provision {target.name} creates it")
        if request.unprivileged and request.device.gid is not None:  # asked before anything is made
            _subids(s, target, request.device.gid, yes, confirm)
        _create(s, target, request)
    conf_path = kind.node_path(f"/etc/pve/lxc/{target.ctid}.conf")
    sidecar = kind.node_path(owned_path(target.ctid))
    raw, owned = _read_config(s, conf_path, sidecar, created=state == "missing")
    config = RawConfig.parse(raw)
    if config.lock:
        raise ProvisionError(f"CT {target.ctid} is locked ({config.lock}): provision changes nothing while a "
                             f"{config.lock} holds it (`pct unlock {target.ctid}` only when none runs)")
    paths = gpu_device_paths(gpus, node.devices)
    options = wanted_devn(config, paths, request.device) if node.devn else {}
    if request.features and config.options.get("features") != request.features:
        options["features"] = request.features
    for key, value in (("memory", request.memory_mib), ("cores", request.cores)):
        if value is not None and state != "missing" and config.options.get(key) != str(value):
            options[key] = str(value)
    shm = request.shm_gib if request.shm_gib is not None else (default_shm_gib(gpus) if gpus else None)
    wanted = wanted_lxc(gpus=gpus, devices=node.devices, devn=node.devn, uvm_major=node.uvm_major, shm_gib=shm,
                        limits=bool(gpus))
    unprivileged = config.options.get("unprivileged", "1" if state == "missing" and request.unprivileged else "0") == "1"
    if unprivileged and request.device.gid is not None:
        wanted += idmap_lines(request.device.gid)
        if state != "missing":
            _subids(s, target, request.device.gid, yes, confirm)
    plan = plan_lxc(config, owned, wanted)
    for theirs, ours in plan.kept_foreign:
        s.outcome.notes.append(f"kept the config's own `{theirs[0]}: {theirs[1]}` (not written by dflash-ops) "
                               f"where provision would write `{ours[0]}: {ours[1]}`")
    s.outcome.diff = [f"+{k}: {v}    (pct set)" for k, v in options.items()] + config_diff(
        raw, plan.new_text, f"/etc/pve/lxc/{target.ctid}.conf")
    config_changed = bool(options) or plan.changed
    running = state == "running"
    if config_changed and running:
        _may_restart(container, target, yes, confirm, dry_run)
    if options:
        argv = list(render.pct_argv(pct, "set", target.ctid, *[w for k, v in options.items() for w in (f"--{k}", v)]))
        s.change(f"pct set {target.ctid}: " + ", ".join(f"{k}={v}" for k, v in options.items()), node_rendered(argv))
    if plan.changed:
        if options and not dry_run:  # pct set rewrote the file: plan again on what it wrote
            raw, owned = _read_config(s, conf_path, sidecar)
            plan = plan_lxc(RawConfig.parse(raw), owned, wanted)
        digest = hashlib.sha256(raw.encode()).hexdigest()
        lock = kind.node_path(f"/run/lock/lxc/pve-config-{target.ctid}.lock")
        what = "; ".join([*(f"append `{k}: {v}`" for k, v in plan.added),
                          *(f"replace our `{a[0]}: {a[1]}` by `{b[1]}`" for a, b in plan.replaced)])
        s.change(f"{conf_path}: {what}", node_rendered(
            ["flock", "-w", str(LOCK_WAIT_S), lock, "sh", "-c", _REPLACE, "sh", digest, conf_path]),
            stdin=plan.new_text.encode())
        s.change(f"record our lines in {sidecar}", node_rendered(["sh", "-c", _WRITE, "sh", sidecar]),
                 stdin=render_owned(target.ctid, plan.owned).encode(), count=False)
    if not running:
        s.change(f"pct start {target.ctid}", node_rendered(list(render.pct_argv(pct, "start", target.ctid))))
    elif config_changed:
        s.change(f"restart CT {target.ctid} (pct shutdown, pct start): the new config applies at start",
                 node_rendered(list(render.pct_argv(pct, "shutdown", target.ctid))))
        s.change(f"pct start {target.ctid}", node_rendered(list(render.pct_argv(pct, "start", target.ctid))))
    if dry_run and not running:  # missing or stopped: nothing inside it can be read until it runs (a dry run of a
        # stopped container read python and the libraries through `pct exec`, which fails on it: it planned an
        # install of python3 the real run never does, then ended in "container not running")
        if gpus and node.module and node.packages.installed:
            version, names = driverpkgs.plan(node, target, kind.container_root(target.ctid))
            userspace_line = (f"the node's NVIDIA packages {' '.join(f'{p}={version}' for p in names)} from the "
                              "container's apt sources, held (apt-get install, apt-mark hold)")
        else:
            userspace_line = f"the NVIDIA user-space {node.module or '-'} (the node's kernel module) when GPUs are given"
        where = "in the new container" if state == "missing" else f"in CT {target.ctid} once started (it is {state})"
        s.say(f"# then, {where}: python3 and venv when missing (apt-get), and {userspace_line}")
        return s.outcome
    _python(s, container)
    if gpus or (node.module and paths and paths[0] in (config.passthrough() | config.mounted())):
        userspace.ensure(s, container, node, kind.container_root(target.ctid))
    return s.outcome


def _resolve_gpus(asked: Literal["all"] | tuple[int, ...], node: NodeInfo, target: Target) -> tuple[int, ...]:
    if not asked:
        return ()
    if node.module is None:
        raise ProvisionError(f"node {node.name} has no NVIDIA kernel module loaded (no /proc/driver/nvidia/version): "
                             + (target.node.kind.no_gpus_hint(node.name)
                                or "install the driver on the node first, then provision"))
    if asked == "all":
        if not node.gpus:
            raise ProvisionError(f"node {node.name} has the NVIDIA module {node.module} but no /dev/nvidiaN (after a "
                                 "reboot they appear once nvidia-smi runs on the node; --boot-unit installs a unit "
                                 "that makes them at every boot)")
        return node.gpus
    missing = [g for g in asked if g not in node.gpus]
    if missing:
        have = ", ".join(f"/dev/nvidia{g}" for g in node.gpus) or "none"
        raise ProvisionError(f"GPU {','.join(map(str, missing))} is not on node {node.name} (it has {have})")
    return tuple(asked)


def _create(s: _Session, target: Target, request: Request) -> None:
    kind = target.node.kind
    template = request.template or kind.default_template()
    if not template:
        raise ProvisionError(f"container {target.ctid} does not exist on node {target.node.name}: pass "
                             "--from-template VOLID (`pveam list local` on the node lists its templates)")
    args = [template, "--hostname", target.name, "--unprivileged", "1" if request.unprivileged else "0",
            "--net0", "name=eth0,bridge=vmbr0,ip=dhcp"]
    for option, value in (("--cores", request.cores), ("--memory", request.memory_mib), ("--rootfs", request.rootfs)):
        if value is not None:
            args += [option, str(value)]
    argv = list(render.pct_argv(target.node.pct, "create", target.ctid, *args, *kind.create_options(target.ctid)))
    s.change(f"pct create {target.ctid} from {template}", node_rendered(argv))


_APPEND = 'printf "%s\\n" "$2" >> "$1"'  # the node's file edited in place (it is the admin's)


def _subids(s: _Session, target: Target, gid: int, yes: bool, confirm: Confirm) -> None:
    """An idmap of group `gid` needs the node's /etc/subuid and /etc/subgid to let root map it (else
    lxc-start: "newgidmap failed to write mapping"): read them; a missing line is added, in place, only
    after a yes (--yes)."""
    kind = target.node.kind
    files = {name: kind.node_path(f"/etc/{name}") for name in ("subuid", "subgid")}
    out = s.read("the node's /etc/subuid and /etc/subgid", ["sh", "-c", _READ, "sh", *files.values()])
    texts: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("--- dflash-ops "):
            current = line[len("--- dflash-ops "):]
            texts[current] = []
        elif current is not None:
            texts[current].append(line)
    wanted = {"subuid": [(ID_BASE, ID_RANGE)], "subgid": [(ID_BASE, ID_RANGE), (gid, 1)]}
    lines = [(name, f"root:{start}:{count}") for name, ranges in wanted.items()
             for start, count in subid_missing("\n".join(texts.get(files[name], [])), ranges)]
    if not lines:
        return
    what = ", ".join(f"`{line}` to /etc/{name}" for name, line in lines)
    if not (s.dry_run or yes or confirm(f"node {target.node.name}: add {what} (root may map group {gid})?")):
        raise ProvisionError(f"node {target.node.name}: /etc/subgid does not let root map group {gid} and was not "
                             f"changed: add {what} yourself, or rerun with --yes")
    for name, line in lines:
        s.change(f"node {target.node.name}: add `{line}` to /etc/{name}",
                 node_rendered(["sh", "-c", _APPEND, "sh", files[name], line]))


def _read_config(s: _Session, conf_path: str, sidecar: str, created: bool = False) -> tuple[str, list]:
    if created and s.dry_run:
        return "", []
    out = s.read("the container's config and the lines provision owns", ["sh", "-c", _READ, "sh", conf_path, sidecar])
    parts: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines(keepends=True):
        if line.startswith("--- dflash-ops "):
            current = line[len("--- dflash-ops "):].rstrip("\n")
            parts[current] = []
        elif current is not None:
            parts[current].append(line)
    return "".join(parts.get(conf_path, [])), parse_owned("".join(parts.get(sidecar, [])))


def _may_restart(container: Container, target: Target, yes: bool, confirm: Confirm, dry_run: bool) -> None:
    """A running container takes device entries and lxc.* lines at its next start: never while a run
    of ours is live in it, and only when the user says so (or --yes)."""
    from dflash_ops.runs import list_runs

    try:
        live = [r for r in list_runs(container) if r.alive and not r.final]
    except DflashOpsError as e:
        raise ProvisionError(f"CT {target.ctid} runs: cannot tell whether a run of ours is live ({e}); "
                             "not restarting it") from None
    if live:
        held = "; ".join(f"{r.run_id} (GPU {','.join(map(str, r.gpus)) or '-'})" for r in live)
        raise ProvisionError(f"CT {target.ctid} has a live run of ours: {held}: provision does not restart it; "
                             f"dflash-ops run stop {target.name} RUN first")
    if dry_run or yes:
        return
    if not confirm(f"CT {target.ctid} is running: restart it to apply the new config?"):
        raise ProvisionError(f"CT {target.ctid} not restarted, nothing changed: rerun with --yes to restart it")


def _python(s: _Session, container: Container) -> None:
    """deploy needs python3 with venv (and ensurepip): a fresh Debian CT lacks python3-venv."""
    python = container.target.python
    check = container.exec([python, "-c", "import venv, ensurepip"], timeout=60)
    s.show("python3 with venv and ensurepip (read)", container.render([python, "-c", "import venv, ensurepip"]))
    if check.ok:
        return
    s.change("apt-get update in the container", container.render(["apt-get", "update"]))
    s.change("install python3 and python3-venv in the container",
             container.render(["env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "python3",
                               "python3-venv"]))
