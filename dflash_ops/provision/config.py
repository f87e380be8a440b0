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
    if key == "lxc.idmap":  # what a map decides: the kind and first id inside the container
        return f"{key} {' '.join(value.split()[:2])}"
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
    """/dev/nvidiaN of the GPUs, then the control and uvm nodes the node has; none without GPUs (a
    container is a GPU container because GPUs were asked for, not because the node has the nodes)."""
    if not gpus:
        return []
    extra = [f"/dev/{n}" for n in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools") if n in devices]
    return [f"/dev/nvidia{g}" for g in gpus] + extra


@dataclass(frozen=True)
class DeviceAccess:
    """Who may open the device nodes inside the container: pct's devN `uid=`, `gid=`, `mode=`
    (pve-container creates each node with them; without, root:root 0660 and a non-root user gets
    `permission denied`). None: not asked (the entry says nothing of it)."""

    uid: int | None = None
    gid: int | None = None
    mode: str | None = None  # octal, e.g. 0660

    def __bool__(self) -> bool:
        return self.uid is not None or self.gid is not None or self.mode is not None

    def entry(self, path: str) -> str:
        """The devN value for `path` (pct's property string: path first, then the keys sorted)."""
        keys = {"gid": self.gid, "mode": self.mode, "uid": self.uid}
        return ",".join([path, *(f"{k}={v}" for k, v in sorted(keys.items()) if v is not None)])

    def held_by(self, value: str) -> bool:
        """Whether a devN value already says what is asked (other keys of it are left alone)."""
        fields = dict(part.split("=", 1) for part in value.split(",")[1:] if "=" in part)
        asked = {"gid": self.gid, "mode": self.mode, "uid": self.uid}
        return all(v is None or fields.get(k) == str(v) for k, v in asked.items())


def wanted_devn(config: RawConfig, paths: list[str], access: DeviceAccess = DeviceAccess()) -> dict[str, str]:
    """`pct set` options giving the container each path not yet passed through (or bind-mounted by
    the admin): devK in the first free slots; with `access`, an entry of one of `paths` that does
    not say it yet is set again in its own slot (asked for by the user, so it is no silent rewrite)."""
    entries = {v.split(",")[0].removeprefix("path="): (k, v) for k, v in config.options.items()
               if re.fullmatch(r"dev\d+", k)}
    have = set(entries) | config.mounted()
    missing = [p for p in paths if p not in have]
    options = dict(zip(config.free_dev_slots(), [access.entry(p) for p in missing]))
    if access:
        for path in paths:
            if path in entries and not access.held_by(entries[path][1]):
                options[entries[path][0]] = access.entry(path)
    return options


ID_RANGE = 65536  # pve-container's unprivileged map: container ids 0..65535 -> node 100000..165535
ID_BASE = 100000


def idmap_lines(gid: int) -> list[Line]:
    """lxc.idmap lines of an unprivileged container whose group `gid` is the node's group `gid`
    (the rest as pve-container maps it), so files of that group (device nodes bound from the node,
    a dataset directory) are the container's group too. The node's /etc/subgid must allow root to
    map `gid` (subgid_line)."""
    lines: list[Line] = [("lxc.idmap", f"u 0 {ID_BASE} {ID_RANGE}")]
    if gid > 0:
        lines.append(("lxc.idmap", f"g 0 {ID_BASE} {gid}"))
    lines.append(("lxc.idmap", f"g {gid} {gid} 1"))
    if gid + 1 < ID_RANGE:
        lines.append(("lxc.idmap", f"g {gid + 1} {ID_BASE + gid + 1} {ID_RANGE - gid - 1}"))
    return lines


def subid_missing(text: str, wanted: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Of `wanted` (start, count) ranges, those root may not map by an /etc/subuid or /etc/subgid text."""
    held = []
    for line in text.splitlines():
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[0] in ("root", "0") and parts[1].isdigit() and parts[2].isdigit():
            held.append((int(parts[1]), int(parts[2])))
    return [(start, count) for start, count in wanted
            if not any(a <= start and start + count <= a + n for a, n in held)]


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
