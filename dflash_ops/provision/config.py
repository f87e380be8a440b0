"""The container's config file as provision changes it: options through `pct set`, `lxc.*` lines it owns.

pve-container keeps `/etc/pve/lxc/VMID.conf` as `key: value` options, then raw `lxc.*` lines, then
`[snapshot]` sections. Every `pct set` rewrites the file (write_pct_config): '#' lines are the
container's description and move to the top, options are sorted, lxc.* lines keep their order. So a
comment next to a line cannot mark it as ours: provision records the lines it appended in a sidecar
file on the node (OWNED_DIR/VMID.json, key and value of each line, as pct rewrites `=` to `: `) and
treats every other line as the admin's: kept as it is, never rewritten or removed.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field

LXC_LINE = re.compile(r"^(lxc\.[a-z0-9_\-.]+)(:|\s*=)\s*(.*?)\s*$")  # pve-container parse_pct_config
OWNED_DIR = "/var/lib/dflash-ops/provision"
NVIDIA_MAJOR = 195

Line = tuple[str, str]  # an lxc.* line: (key, value)


@dataclass
class RawConfig:
    """The current section of a config file (what pct set and LXC read), and the rest kept as it is."""

    text: str
    options: dict[str, str] = field(default_factory=dict)
    lxc: list[Line] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> RawConfig:
        config = cls(text)
        for line in text.splitlines():
            if line.startswith("["):
                break
            if not line.strip() or line.startswith("#"):
                continue
            raw = LXC_LINE.match(line)
            if raw:
                config.lxc.append((raw.group(1), raw.group(3)))
            else:
                key, sep, value = line.partition(":")
                if sep:
                    config.options[key.strip()] = value.strip()
        return config

    @property
    def lock(self) -> str | None:
        return self.options.get("lock") or None

    def passthrough(self) -> set[str]:
        return {v.split(",")[0].removeprefix("path=") for k, v in self.options.items() if re.fullmatch(r"dev\d+", k)}

    def mounted(self) -> set[str]:
        return {v.split()[0] for k, v in self.lxc if k == "lxc.mount.entry" and v.split()}

    def free_dev_slots(self) -> list[str]:
        used = {int(k[3:]) for k in self.options if re.fullmatch(r"dev\d+", k)}
        return [f"dev{i}" for i in range(256) if i not in used]


def slot(line: Line) -> str:
    """What one line decides: a mount entry its destination, a limit its key, an allow rule itself.
    Two lines of one slot would fight (two /dev/shm mounts), so provision never adds a second."""
    key, value = line
    if key == "lxc.mount.entry":
        words = value.split()
        return f"{key} {words[1] if len(words) > 1 else value}"
    if key.startswith("lxc.prlimit."):
        return key
    return f"{key} {value}"


@dataclass
class LxcPlan:
    new_text: str
    owned: list[Line]  # our lines once the new text is written
    added: list[Line] = field(default_factory=list)
    replaced: list[tuple[Line, Line]] = field(default_factory=list)  # (our old line, our new one)
    kept_foreign: list[tuple[Line, Line]] = field(default_factory=list)  # (the admin's line, the one we wanted)

    @property
    def changed(self) -> bool:
        return bool(self.added or self.replaced)


def plan_lxc(config: RawConfig, owned: list[Line], wanted: list[Line]) -> LxcPlan:
    """The config text with `wanted` lines present: a line already there (ours or not) stays; our
    own line of the same slot is replaced in place; a slot the admin's line holds is left to it
    (reported); the rest is appended at the end of the current section (before any [snapshot])."""
    present = set(config.lxc)
    ours = [line for line in owned if line in present]  # a recorded line someone removed is no longer ours
    by_slot_ours = {slot(line): line for line in ours}
    by_slot_foreign = {slot(line): line for line in config.lxc if line not in ours}
    head, sep, rest = config.text.partition("\n[")
    lines = head.splitlines()
    plan = LxcPlan(new_text=config.text, owned=list(ours))
    append: list[Line] = []
    for line in wanted:
        if line in present:
            if line not in plan.owned and line in ours:
                plan.owned.append(line)
            continue
        old = by_slot_ours.get(slot(line))
        if old is not None:
            index = next(i for i, text in enumerate(lines) if _is(text, old))
            lines[index] = f"{line[0]}: {line[1]}"
            plan.replaced.append((old, line))
            plan.owned[plan.owned.index(old)] = line
            continue
        foreign = by_slot_foreign.get(slot(line))
        if foreign is not None:
            plan.kept_foreign.append((foreign, line))
            continue
        append.append(line)
    while lines and not lines[-1].strip():
        lines.pop()
    lines += [f"{k}: {v}" for k, v in append]
    plan.added = append
    plan.owned += append
    if plan.changed:
        plan.new_text = "\n".join(lines) + "\n" + ("\n[" + rest if sep else "")
    return plan


def _is(text: str, line: Line) -> bool:
    raw = LXC_LINE.match(text)
    return raw is not None and (raw.group(1), raw.group(3)) == line


def wanted_lxc(*, gpus: tuple[int, ...], devices: tuple[str, ...], devn: bool, uvm_major: int | None,
               shm_gib: int | None, limits: bool) -> list[Line]:
    """The lxc.* lines a GPU container needs: /dev/shm as a tmpfs of the asked size, memlock and
    nofile limits (NCCL's troubleshooting guide), and on a node without devN entries the GPUs as
    bind mounts with their cgroup allow rules."""
    lines: list[Line] = []
    if gpus and not devn:
        lines.append(("lxc.cgroup2.devices.allow", f"c {NVIDIA_MAJOR}:* rwm"))
        if uvm_major is not None:
            lines.append(("lxc.cgroup2.devices.allow", f"c {uvm_major}:* rwm"))
        for path in gpu_device_paths(gpus, devices):
            lines.append(("lxc.mount.entry", f"{path} {path[1:]} none bind,optional,create=file"))
    if shm_gib:
        lines.append(("lxc.mount.entry", f"tmpfs dev/shm tmpfs rw,nosuid,nodev,size={shm_gib}G,create=dir 0 0"))
    if limits:
        lines += [("lxc.prlimit.memlock", "unlimited"), ("lxc.prlimit.nofile", "1048576")]
    return lines


def gpu_device_paths(gpus: tuple[int, ...], devices: tuple[str, ...]) -> list[str]:
    """/dev/nvidiaN of the GPUs, then the control and uvm nodes the node has."""
    extra = [f"/dev/{n}" for n in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools") if n in devices]
    return [f"/dev/nvidia{g}" for g in gpus] + extra


def wanted_devn(config: RawConfig, paths: list[str]) -> dict[str, str]:
    """`pct set` options giving the container each path not yet passed through (or bind-mounted by
    the admin): devK in the first free slots."""
    have = config.passthrough() | config.mounted()
    missing = [p for p in paths if p not in have]
    return dict(zip(config.free_dev_slots(), missing))


def config_diff(old: str, new: str, label: str) -> list[str]:
    return list(difflib.unified_diff(old.splitlines(), new.splitlines(), f"{label} (now)", f"{label} (provisioned)",
                                     lineterm=""))


def owned_path(ctid: int) -> str:
    return f"{OWNED_DIR}/{ctid}.json"


def parse_owned(text: str) -> list[Line]:
    try:
        doc = json.loads(text or "{}")
    except ValueError:
        return []
    return [(str(k), str(v)) for k, v in doc.get("lines", []) if isinstance(k, str)]


def render_owned(ctid: int, lines: list[Line]) -> str:
    return json.dumps({"ctid": ctid, "lines": [list(line) for line in lines],
                       "what": "lxc.* lines dflash-ops provision appended to this container's config"}, indent=1) + "\n"
