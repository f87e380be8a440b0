"""A stand-in for Proxmox VE's `pct`, with the real syntax, messages and exit codes.

Run as `python -m dflash_ops.simnode.pct [--state-root DIR] COMMAND ...` or by file path
(stdlib only, imports nothing from dflash_ops, so it needs no PYTHONPATH behind sshd).

Implemented: exec, push, pull, status, list, start, stop, destroy, config. Messages and exit codes
follow pve-container's src/PVE/CLI/pct.pm (errors from `die` exit 255; push/pull failures
inside the forked worker are printed and exit 0, as on a real node - verify transfers).

Simulated containers share this machine's filesystem: there is no chroot, so a target's
base_dir is a real path here. State lives under the state root (--state-root, else
$DFLASH_OPS_SIM_ROOT, else ~/.local/state/dflash-ops/sim):

    ROOT/lxc/<vmid>.conf        "status: running" or "status: stopped"
    ROOT/lxc/<vmid>.destroyed   tombstone left by `pct destroy`
    ROOT/bin/python3            wrapper exec'ing this stand-in's own interpreter

Every VMID exists, running, on first use unless it was destroyed. `exec` gives the process
PATH=ROOT/bin:/sbin:/bin:/usr/sbin:/usr/bin plus the caller's environment (pct keeps the
SSH session's environment), so `python3` in a simulated container is the interpreter (and
venv) running the stand-in. ROOT/bin/python3 is a wrapper script, not a symlink, because a
symlink to a venv's python loses the venv.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import sys
from pathlib import Path

CONTAINER_PATH = "/sbin:/bin:/usr/sbin:/usr/bin"
USAGE = "USAGE: pct <COMMAND> [ARGS] [OPTIONS]"


class PctError(Exception):
    """A `die` in pct.pm: message on stderr, exit status 255."""


class Node:
    def __init__(self, root: Path):
        self.root = root
        self.lxc = root / "lxc"

    def conf(self, vmid: str) -> Path:
        return self.lxc / f"{vmid}.conf"

    def ensure(self, vmid: str) -> None:
        if not vmid.isdigit() or not 100 <= int(vmid) <= 999_999_999:
            raise PctError(
                "400 Parameter verification failed.\n"
                "vmid: invalid format - value does not look like a valid VM ID\n"
            )
        if (self.lxc / f"{vmid}.destroyed").exists():
            nodename = socket.gethostname().split(".")[0]
            raise PctError(f"Configuration file 'nodes/{nodename}/lxc/{vmid}.conf' does not exist\n")
        if not self.conf(vmid).exists():
            self.set_status(vmid, "running")

    def status(self, vmid: str) -> str:
        self.ensure(vmid)
        return self.conf(vmid).read_text().split(":", 1)[1].strip()

    def set_status(self, vmid: str, status: str) -> None:
        self.lxc.mkdir(parents=True, exist_ok=True)
        _write_atomically(self.conf(vmid), f"status: {status}\n")

    def vmids(self) -> list[str]:
        if not self.lxc.is_dir():
            return []
        return sorted((p.stem for p in self.lxc.glob("*.conf")), key=int)

    def python_dir(self) -> Path:
        bin_dir = self.root / "bin"
        wrapper = bin_dir / "python3"
        text = f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n"
        if not wrapper.exists() or wrapper.read_text() != text:
            bin_dir.mkdir(parents=True, exist_ok=True)
            _write_atomically(wrapper, text, mode=0o755)
        return bin_dir


def _write_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def split_options(words: list[str], names: set[str]) -> tuple[list[str], dict[str, str]]:
    """Perl Getopt style: `--name value` / `-name value` anywhere among the words."""
    positional, options = [], {}
    i = 0
    while i < len(words):
        word = words[i]
        name = word.lstrip("-")
        if word.startswith("-") and word != "-" and name:
            name, eq, value = name.partition("=")
            if name not in names:
                raise PctError(f"Unknown option: {name}\n400 unable to parse option\n")
            if not eq:
                if i + 1 >= len(words):
                    raise PctError(f"Option {name} requires an argument\n400 unable to parse option\n")
                i += 1
                value = words[i]
            options[name] = value
        else:
            positional.append(word)
        i += 1
    return positional, options


def need(positional: list[str], names: list[str], command: str) -> list[str]:
    if len(positional) < len(names):
        raise PctError(f"400 not enough arguments\npct {command} <{'> <'.join(names)}>\n")
    if len(positional) > len(names):
        raise PctError(f"400 too many arguments\npct {command} <{'> <'.join(names)}>\n")
    return positional


def cmd_exec(node: Node, words: list[str]) -> int:
    if "--" in words:
        cut = words.index("--")
        before, argv = words[:cut], words[cut + 1 :]
        positional, _ = split_options(before, {"keep-env"})
    else:
        positional, _ = split_options(words, {"keep-env"})
        positional, argv = positional[:1], positional[1:]
    (vmid,) = need(positional, ["vmid"], "exec") if positional else need([], ["vmid"], "exec")
    node.ensure(vmid)
    if node.status(vmid) != "running":
        raise PctError(f"Error: container '{vmid}' not running!\n")
    if not argv:
        raise PctError("missing command\n")
    env = dict(os.environ)
    env["PATH"] = f"{node.python_dir()}:{CONTAINER_PATH}"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        sys.stderr.write(
            f"lxc-attach: {vmid}: attach.c: lxc_attach_run_command: {e.strerror} - Failed to exec \"{argv[0]}\"\n"
        )
        return 255
    return 0  # not reached


def _create_file(path: str, perms: str | None):
    mode = None
    if perms is not None:
        text = perms if perms.startswith("0") else "0" + perms
        try:
            mode = int(text, 16) if text.lower().startswith("0x") else int(text, 8)
        except ValueError:
            raise OSError(f"invalid mode: '{perms}'") from None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    if mode is not None:
        os.fchmod(fd, mode)
    return os.fdopen(fd, "wb")


def _copy(src: str, dst: str, opts: dict[str, str]) -> None:
    try:
        src_file = open(src, "rb")
    except OSError:
        sys.stderr.write(f"failed to open {src} for reading\n")
        return
    with src_file:
        try:
            dst_file = _create_file(dst, opts.get("perms"))
        except OSError as e:
            sys.stderr.write(f"failed to create file: {dst}: {e.strerror or e}\n")
            return
        with dst_file:
            while chunk := src_file.read(1 << 20):
                dst_file.write(chunk)
        if "user" in opts or "group" in opts:
            try:
                os.chown(dst, int(opts.get("user", -1)), int(opts.get("group", -1)))
            except (OSError, ValueError) as e:
                sys.stderr.write(f"failed to change file owner: {e}\n")


def cmd_push(node: Node, words: list[str]) -> int:
    positional, opts = split_options(words, {"perms", "user", "group"})
    vmid, src, dst = need(positional, ["vmid", "file", "destination"], "push")
    node.ensure(vmid)
    if node.status(vmid) != "running":
        raise PctError("can only push files to a running CT\n")
    _copy(src, dst, opts)
    return 0


def cmd_pull(node: Node, words: list[str]) -> int:
    positional, opts = split_options(words, {"perms", "user", "group"})
    vmid, src, dst = need(positional, ["vmid", "path", "destination"], "pull")
    node.ensure(vmid)
    if node.status(vmid) != "running":
        raise PctError("can only pull files from a running VM\n")
    _copy(src, dst, opts)
    return 0


def cmd_status(node: Node, words: list[str]) -> int:
    positional, _ = split_options(words, {"verbose"})
    (vmid,) = need(positional, ["vmid"], "status")
    print(f"status: {node.status(vmid)}")
    return 0


def cmd_list(node: Node, words: list[str]) -> int:
    need(words, [], "list")
    vmids = node.vmids()
    if vmids:
        row = "%-10s %-10s %-12s %-20s"
        print(row % ("VMID", "Status", "Lock", "Name"))
        for vmid in vmids:
            print(row % (vmid, node.status(vmid), "", f"sim{vmid}"))
    return 0


def cmd_start(node: Node, words: list[str]) -> int:
    (vmid,) = need(words, ["vmid"], "start")
    if node.status(vmid) == "running":
        raise PctError(f"CT {vmid} already running\n")
    node.set_status(vmid, "running")
    return 0


def cmd_stop(node: Node, words: list[str]) -> int:
    (vmid,) = need(words, ["vmid"], "stop")
    if node.status(vmid) != "running":
        raise PctError(f"CT {vmid} not running\n")
    node.set_status(vmid, "stopped")
    return 0


def cmd_destroy(node: Node, words: list[str]) -> int:
    (vmid,) = need(words, ["vmid"], "destroy")
    if node.status(vmid) == "running":
        raise PctError(f"unable to destroy CT {vmid} - container is running\n")
    (node.lxc / f"{vmid}.destroyed").touch()
    node.conf(vmid).unlink()
    return 0


# ---------------------------------------------------------------- pct config
# A simulated container's Proxmox config is ROOT/lxc/<vmid>.pve.conf in the format of
# /etc/pve/lxc/<vmid>.conf (tests write one to give a CT GPU entries); absent, a plain CPU CT.

def default_pve_conf(vmid: str) -> str:
    return (f"arch: amd64\ncores: 2\nhostname: sim{vmid}\nmemory: 2048\n"
            "net0: name=eth0,bridge=vmbr0,ip=dhcp,type=veth\nostype: debian\n"
            f"rootfs: local-lvm:vm-{vmid}-disk-0,size=8G\nswap: 512\nunprivileged: 1\n")


def format_config(text: str) -> str:
    """What pct.pm's `config` prints for a config file: options sorted by key (digest left out),
    then the raw lxc.* keys in file order. Only the current section is read ([snapshot] and
    [pve:pending] sections are not); '#' description lines are not printed."""
    options, lxc = {}, []
    for line in text.splitlines():
        if line.startswith("["):
            break
        if not line.strip() or line.startswith("#"):
            continue
        raw = re.match(r"^(lxc\.[a-z0-9_\-.]+)(:|\s*=)\s*(.*?)\s*$", line)  # as parse_pct_config
        if raw:
            lxc.append((raw.group(1), raw.group(3)))
        else:
            key, _, value = line.partition(":")
            options[key.strip()] = value.strip()
    return "".join(f"{k}: {options[k]}\n" for k in sorted(options)) + "".join(f"{k}: {v}\n" for k, v in lxc)


def cmd_config(node: Node, words: list[str]) -> int:
    positional, opts = split_options(words, {"current", "snapshot"})
    (vmid,) = need(positional, ["vmid"], "config")
    node.ensure(vmid)
    if "snapshot" in opts:
        raise PctError(f"snapshot '{opts['snapshot']}' does not exist\n")
    path = node.lxc / f"{vmid}.pve.conf"
    sys.stdout.write(format_config(path.read_text() if path.exists() else default_pve_conf(vmid)))
    return 0


COMMANDS = {
    "exec": cmd_exec,
    "push": cmd_push,
    "pull": cmd_pull,
    "status": cmd_status,
    "list": cmd_list,
    "start": cmd_start,
    "stop": cmd_stop,
    "destroy": cmd_destroy,
    "config": cmd_config,
}


def main(args: list[str]) -> int:
    root = os.environ.get("DFLASH_OPS_SIM_ROOT", "~/.local/state/dflash-ops/sim")
    if args[:1] == ["--state-root"] and len(args) >= 2:
        root, args = args[1], args[2:]
    node = Node(Path(root).expanduser())
    if not args or args[0] not in COMMANDS:
        shown = f"pct {args[0]}" if args else "pct"
        sys.stderr.write(f"ERROR: unknown command '{shown}'\n{USAGE}\n")
        return 255
    try:
        return COMMANDS[args[0]](node, args[1:])
    except PctError as e:
        sys.stderr.write(str(e))
        return 255


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
