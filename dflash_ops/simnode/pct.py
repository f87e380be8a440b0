"""A stand-in for Proxmox VE's `pct`, as strict as a real node where a real node is strict.

Run as `python -m dflash_ops.simnode.pct [--state-root DIR] COMMAND ...` or by file path
(stdlib only, imports nothing from dflash_ops, so it needs no PYTHONPATH behind sshd).

Implemented: create, set, exec, push, pull, status, list, start, stop, shutdown, destroy, config. Every message and
exit code below is read from the sources cited next to it (pve-container src/PVE/CLI/pct.pm,
pve-common src/PVE/{CLIHandler,RESTEnvironment,Tools}.pm, pve-guest-common
src/PVE/AbstractConfig.pm, lxc src/lxc/{attach.c,tools/lxc_attach.c}). A `die` in pct exits
255 with its message on stderr; a message without a trailing newline gets Perl's
" at FILE line N." appended, as on a node.

What is modelled (docs/simulated-node.md says what is not):

* containers exist only once created (`pct create`); anything else gets pct's messages;
* `pct exec` runs ARGV with exactly the environment pct hands lxc-attach: the caller's
  (keep-env, pct's default) less SSL_CERT_FILE/SSL_CERT_DIR, PATH=/sbin:/bin:/usr/sbin:/usr/bin,
  plus container=lxc; a missing command exits 127, a non-executable one 126, a signal 128+N;
* each container has its own python: CT_ROOT/usr/bin/python3, a real interpreter that sees
  only the standard library and the packages its create step provisioned (the stand-in for
  `apt install python3-torch`), none of the operator's venv. It is not on pct's PATH (there
  is no chroot), so an inventory names it by its absolute path;
* push, pull, start, stop, create and destroy hold the container's config lock for the whole
  task; a second one waits 10 s, then fails like pct;
* `please run as root`: the simulated node's root is the owner of its state root (root for the
  sshd tier, the operator for the embedded default), so a non-root login must use `sudo pct`.

State lives under the state root (--state-root, else $DFLASH_OPS_SIM_ROOT, else
~/.local/state/dflash-ops/sim):

    ROOT/lxc/<vmid>.conf        the container's config (created by `pct create`)
    ROOT/lxc/<vmid>.state       "running" or "stopped"
    ROOT/lock/pve-config-<vmid>.lock   the config lock (flock), /run/lock/lxc/... on a node
    ROOT/ct/<vmid>/             the container's own files: usr/bin/python3 and its site-packages
    ROOT/node/                  the node's own files a test gives it: dev/nvidia*, proc/driver/nvidia/version,
                                proc/devices (dflash_ops/simnode/gpus.py writes them); a devN entry names
                                /dev/X, which is ROOT/node/dev/X here
"""

from __future__ import annotations

# `_signal`, the C module the `signal` module wraps, has the same functions and numbers (ints, not enums):
# importing `signal` builds its enums (enum, functools, collections: ~4 of the ~13 ms a `pct exec`
# spends before it execs), and exec resets every signal's disposition (_default_signals)
import _signal as signal
import errno
import fcntl
import os
import sys
import time

# Annotations only (typing.TYPE_CHECKING, which mypy reads by its name, without importing typing); json,
# shutil, re and pathlib are imported where used: every `pct exec` starts a Python, and what its path does
# not use was ~5 of its 30 ms (json, shutil), then ~12 of the 30 left (re, pathlib: `exec` reads its files
# through os.path, see Node).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from importlib import metadata
    from pathlib import Path
    from typing import BinaryIO, Callable

# pve-common src/PVE/CLIHandler.pm run_cli_handler: `$ENV{'PATH'} = '/sbin:/bin:/usr/sbin:/usr/bin';`
# before any command runs; `pct exec` then calls lxc-attach --keep-env, which keeps it.
CONTAINER_PATH = "/sbin:/bin:/usr/sbin:/usr/bin"
# lxc src/lxc/attach.c lxc_attach_set_environment: with --clear-env, PATH is reset to this.
LXC_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# pve-container src/PVE/CLI/pct.pm clean_environment: deleted before lxc-attach.
DROPPED_ENV = ("SSL_CERT_FILE", "SSL_CERT_DIR")
# pve-guest-common src/PVE/AbstractConfig.pm lock_config: lock_config_full($vmid, 10, ...).
LOCK_TIMEOUT = 10.0
PCT_PM = "/usr/share/perl5/PVE/CLI/pct.pm"
USAGE = "USAGE: pct <COMMAND> [ARGS] [OPTIONS]"
# The packages `pct create --sim-packages` provisions by default: what the bundled trainer
# imports (trainer/requirements.txt), with everything they require.
DEFAULT_SIM_PACKAGES = ("torch", "transformers", "safetensors", "pyyaml")


class PctError(Exception):
    """A `die` in pct: message on stderr, exit status 255 (Perl's exit for an uncaught die)."""


def perl_die(message: str, line: int) -> PctError:
    """A die without a trailing newline: Perl appends where it died."""
    return PctError(f"{message} at {PCT_PM} line {line}.\n")


class Node:
    """The simulated node's state under its state root. `top` is that root as a string: what `pct exec`
    reads (exists, load_config, backend, running) goes through os.path, without pathlib; `root` and
    `lxc` are Paths for everything else."""

    def __init__(self, root: str | os.PathLike[str]):
        self.top = os.fspath(root)

    @property
    def root(self) -> Path:
        from pathlib import Path

        return Path(self.top)

    @property
    def lxc(self) -> Path:
        return self.root / "lxc"

    def _read(self, *parts: str) -> str:
        """A state file's text (OSError as Path.read_text raises it)."""
        with open(os.path.join(self.top, *parts)) as f:
            return f.read()

    def nodename(self) -> str:
        return os.uname().nodename.split(".")[0]  # = gethostname() on Linux

    def conf(self, vmid: str) -> Path:
        return self.lxc / f"{vmid}.conf"

    def ct_root(self, vmid: str) -> Path:
        return self.root / "ct" / vmid

    def exists(self, vmid: str) -> bool:
        # A config from before `pct create` existed (one "status:" line) is not a container.
        try:
            return "\nrootfs: " in "\n" + self._read("lxc", f"{vmid}.conf")
        except OSError:
            return False

    def load_config(self, vmid: str) -> str:
        check_vmid(vmid)
        if not self.exists(vmid):
            # pve-guest-common src/PVE/AbstractConfig.pm load_config
            raise PctError(f"Configuration file 'nodes/{self.nodename()}/lxc/{vmid}.conf' does not exist\n")
        return self._read("lxc", f"{vmid}.conf")

    def backend(self, vmid: str) -> str:
        """"lxc" or "directory", as `pct create --sim-backend` recorded it (older configs: directory): the
        word after the last "; backend: " of the first "# dflash-ops " line that has one (cmd_create)."""
        try:
            text = self._read("lxc", f"{vmid}.conf")
        except OSError:
            return "directory"
        for line in text.splitlines():
            if line.startswith("# dflash-ops ") and line.find("; backend: ", len("# dflash-ops ")) >= 0:
                value = line.rpartition("; backend: ")[2]
                end = next((i for i, c in enumerate(value) if not (c.isalnum() or c == "_")), len(value))
                if end:
                    return value[:end]
        return "directory"

    def node_path(self, path: str) -> Path:
        """Where a node file (`/dev/nvidia0`, `/proc/driver/nvidia/version`) of the simulated node is."""
        return self.root / "node" / path.lstrip("/")

    def lxc_path(self) -> Path:
        """LXC's lxcpath of this node's containers (/var/lib/lxc on a node): lxc_path()/VMID/config."""
        return self.root / "lxcpath"

    def upper_dir(self, vmid: str) -> Path:
        """An LXC container's overlay upper directory: what it wrote over the shared rootfs."""
        return self.ct_root(vmid) / "delta0"

    def running(self, vmid: str) -> bool:
        """PVE::LXC::check_running: false for a container that does not exist."""
        if not self.exists(vmid):
            return False
        if self.backend(vmid) == "lxc":
            return lxc_init_pid(self, vmid) is not None
        try:
            return self._read("lxc", f"{vmid}.state").strip() == "running"
        except OSError:
            return False

    def set_state(self, vmid: str, state: str) -> None:
        if self.backend(vmid) == "lxc":
            lxc_set_state(self, vmid, state)
        write_atomically(self.lxc / f"{vmid}.state", state + "\n")

    def vmids(self) -> list[str]:
        if not self.lxc.is_dir():
            return []
        return sorted((p.stem for p in self.lxc.glob("*.conf") if self.exists(p.stem)), key=int)

    def lock(self, vmid: str) -> "ConfigLock":
        return ConfigLock(self.root / "lock" / f"pve-config-{vmid}.lock", vmid)


class ConfigLock:
    """PVE::AbstractConfig::lock_config -> PVE::Tools::lock_file_full with a 10 s timeout.

    pve-common src/PVE/Tools.pm lock_file_full: a failed non-blocking flock prints
    "trying to acquire lock..." on stderr, then waits; the alarm of run_with_timeout ends the
    wait with "got timeout", reported as "can't lock file '<file>' - got timeout". The message
    names the node's lock file; ours lives under ROOT/lock.
    """

    def __init__(self, path: Path, vmid: str):
        self.path = path
        self.vmid = vmid
        self.fd = -1

    def __enter__(self) -> "ConfigLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return self
        except BlockingIOError:
            pass
        sys.stderr.write("trying to acquire lock...\n")
        sys.stderr.flush()
        deadline = time.monotonic() + LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                sys.stderr.write(" OK\n")
                return self
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    self.fd = -1
                    raise PctError(f"can't lock file '/run/lock/lxc/pve-config-{self.vmid}.lock' - got timeout\n") from None
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = -1


def check_vmid(vmid: str) -> None:
    # pve-common src/PVE/JSONSchema.pm pve-vmid format, reported by the CLI handler.
    if not vmid.isdigit() or not 100 <= int(vmid) <= 999_999_999:
        raise PctError(
            "400 Parameter verification failed.\n"
            "vmid: invalid format - value does not look like a valid VM ID\n"
        )


def check_lock(text: str) -> None:
    """pve-guest-common src/PVE/AbstractConfig.pm check_lock: a `lock:` option (backup, migrate,
    snapshot, create, mounted...) refuses set, start, stop and destroy: "CT is locked (backup)"."""
    lock = config_options(text).get("lock")
    if lock:
        raise PctError(f"CT is locked ({lock})\n")


def config_options(text: str) -> dict[str, str]:
    """The options of the current section (no lxc.* keys, no '#' description lines)."""
    import re
    options = {}
    for line in text.splitlines():
        if line.startswith("["):
            break
        if not line.strip() or line.startswith("#") or re.match(r"^lxc\.[a-z0-9_\-.]+(:|\s*=)", line):
            continue
        key, sep, value = line.partition(":")
        if sep:
            options[key.strip()] = value.strip()
    return options


def write_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
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


def _boolean(options: dict[str, str], name: str, default: bool) -> bool:
    value = options.get(name)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise PctError(f"400 Parameter verification failed.\n{name}: type check ('boolean') failed - got '{value}'\n")


def container_env(keep_env: bool) -> dict[str, str]:
    """The environment lxc-attach gives the command (pct.pm exec + lxc attach.c)."""
    if keep_env:
        env = {k: v for k, v in os.environ.items() if k not in DROPPED_ENV}
        env["PATH"] = CONTAINER_PATH
    else:
        env = {"PATH": LXC_DEFAULT_PATH}
    env["container"] = "lxc"  # attach.c: putenv("container=lxc"), always
    return env


def cmd_exec(node: Node, words: list[str]) -> int:
    if "--" in words:
        cut = words.index("--")
        positional, opts = split_options(words[:cut], {"keep-env"})
        argv = words[cut + 1 :]
    else:
        positional, opts = split_options(words, {"keep-env"})
        positional, argv = positional[:1], positional[1:]
    (vmid,) = need(positional[:1], ["vmid"], "exec")
    keep_env = _boolean(opts, "keep-env", True)  # pct.pm: default 1 until PVE 9
    node.load_config(vmid)  # pct.pm exec: "test if container exists on this node"
    if not node.running(vmid):
        raise PctError(f"container '{vmid}' not running!\n")  # pct.pm exec
    if not argv:
        raise perl_die("missing command", 246)  # pct.pm exec: die "missing command" (no "\n")
    if node.backend(vmid) == "lxc":
        return lxc_attach(node, vmid, argv, keep_env)
    return attach(vmid, argv, container_env(keep_env))


def _default_signals() -> None:
    """exec keeps ignored signals: Python ignores SIGPIPE and SIGXFSZ, and a caller started in the
    background has SIGINT and SIGQUIT ignored. On a node the command comes from sshd with default
    dispositions (`yes | head` must end by SIGPIPE), so none is passed on."""
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)


def lxc_attach(node: Node, vmid: str, argv: list[str], keep_env: bool) -> int:
    """pct.pm exec: `lxc-attach -n VMID --keep-env|--clear-env -- ARGV`, the command's exit status.

    This process becomes lxc-attach (as pct's exec does), so killing it kills lxc-attach only:
    the command inside the container goes on running, as on a node.
    """
    import shutil
    tool = shutil.which("lxc-attach")
    if tool is None:
        raise PctError("lxc-attach not found: install lxc\n")
    sys.stdout.flush()
    sys.stderr.flush()
    _default_signals()
    env = container_env(keep_env)
    os.execve(tool, [tool, "-P", str(node.lxc_path()), "-n", vmid, "--keep-env" if keep_env else "--clear-env",
                     "--", *argv], env)
    return 255  # not reached


def attach(vmid: str, argv: list[str], env: dict[str, str]) -> int:
    """lxc-attach: run argv in a child, wait, exit with its status or 128+signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            _default_signals()
            os.execvpe(argv[0], argv, env)
        except OSError as e:
            # lxc src/lxc/attach.c lxc_attach_run_command: EACCES/ENOEXEC -> 126, ENOENT -> 127,
            # anything else returns -1 (exit status 255); the error is logged as below.
            code = {errno.EACCES: 126, errno.ENOEXEC: 126, errno.ENOENT: 127}.get(e.errno or 0, 255)
            os.write(2, (f"lxc-attach: {vmid}: ../src/lxc/attach.c: lxc_attach_run_command: 1845 "
                         f"{os.strerror(e.errno or 0)} - Failed to exec \"{argv[0]}\"\n").encode())
            os._exit(code)
        os._exit(255)  # not reached
    # Keep running while the command does; lxc-attach ignores nothing and forwards nothing
    # either, but must not die of the signals meant for the foreground command.
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)
    _, status = os.waitpid(pid, 0)
    # lxc src/lxc/tools/lxc_attach.c main: WEXITSTATUS, or WTERMSIG + 128.
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _create_file(path: str, perms: str | None) -> BinaryIO:
    mode = None
    if perms is not None:
        text = perms if perms.startswith("0") else "0" + perms  # pct.pm: "assume octal as default"
        try:
            mode = int(text, 16) if text.lower().startswith("0x") else int(text, 8)
        except ValueError:
            raise OSError(f"invalid mode: '{perms}'") from None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    if mode is not None:
        os.fchmod(fd, mode)
    return os.fdopen(fd, "wb")


def _copy(src: str, dst: str, opts: dict[str, str], src_msg: str, enter_src: "Callable[[], None]" = lambda: None,
          enter_dst: "Callable[[], None]" = lambda: None) -> None:
    """The forked worker of push/pull: its die is printed, and pct still exits 0 (see below).

    enter_src/enter_dst: move into the mount namespace where the source / destination is (an
    LXC container's, or back to the node's)."""
    enter_src()
    try:
        src_file = open(src, "rb")
    except OSError as e:
        sys.stderr.write(src_msg.format(path=src, error=e.strerror or e))
        return
    enter_dst()
    with src_file:
        try:
            dst_file = _create_file(dst, opts.get("perms"))
        except OSError as e:
            sys.stderr.write(f"failed to create file: {dst}: {e.strerror or e}\n")
            return
        with dst_file:
            while True:
                chunk = src_file.read(1 << 20)
                if not chunk:
                    break
                dst_file.write(chunk)
        if "user" in opts or "group" in opts:
            try:
                os.chown(dst, int(opts.get("user", -1)), int(opts.get("group", -1)))
            except (OSError, ValueError) as e:
                sys.stderr.write(f"failed to change file owner: {e}\n")


# push/pull run their copy in rpcenv->fork_worker; the CLI's worker status does not reach the
# exit code (pct exits 0 even when the copy failed): callers verify every transfer.
def cmd_push(node: Node, words: list[str]) -> int:
    positional, opts = split_options(words, {"perms", "user", "group"})
    vmid, src, dst = need(positional, ["vmid", "file", "destination"], "push")
    check_vmid(vmid)
    with node.lock(vmid):  # pct.pm push: lock_config($vmid, $code) around the whole task
        if not node.running(vmid):
            raise PctError("can only push files to a running CT\n")  # pct.pm push
        in_container(node, vmid, lambda node_side, ct_side: _copy(
            src, dst, opts, "failed to open {path} for reading\n", enter_src=node_side, enter_dst=ct_side))
    return 0


def cmd_pull(node: Node, words: list[str]) -> int:
    positional, opts = split_options(words, {"perms", "user", "group"})
    vmid, src, dst = need(positional, ["vmid", "path", "destination"], "pull")
    check_vmid(vmid)
    with node.lock(vmid):  # pct.pm pull: lock_config($vmid, $code)
        if not node.running(vmid):
            raise perl_die("can only pull files from a running VM", 664)  # pct.pm pull, no "\n"
        in_container(node, vmid, lambda node_side, ct_side: _copy(
            src, dst, opts, "failed to open {path}: {error}\n", enter_src=ct_side, enter_dst=node_side))
    return 0


def cmd_status(node: Node, words: list[str]) -> int:
    positional, _ = split_options(words, {"verbose"})
    (vmid,) = need(positional, ["vmid"], "status")
    node.load_config(vmid)
    print(f"status: {'running' if node.running(vmid) else 'stopped'}")
    return 0


def cmd_list(node: Node, words: list[str]) -> int:
    need(words, [], "list")
    vmids = node.vmids()
    if vmids:
        row = "%-10s %-10s %-12s %-20s"
        print(row % ("VMID", "Status", "Lock", "Name"))
        for vmid in vmids:
            lock = config_options(node.conf(vmid).read_text()).get("lock", "")
            print(row % (vmid, "running" if node.running(vmid) else "stopped", lock, _hostname(node, vmid)))
    return 0


def _hostname(node: Node, vmid: str) -> str:
    import re
    match = re.search(r"^hostname: (.*)$", node.conf(vmid).read_text(), re.M)
    return match.group(1) if match else f"CT{vmid}"


def cmd_start(node: Node, words: list[str]) -> int:
    (vmid,) = need(words, ["vmid"], "start")
    check_vmid(vmid)
    # pve-container src/PVE/API2/LXC/Status.pm vm_start: checked before taking the lock.
    if node.running(vmid):
        raise PctError(f"CT {vmid} already running\n")
    with node.lock(vmid):
        text = node.load_config(vmid)
        check_lock(text)
        check_devices(node, text)
        node.set_state(vmid, "running")
    return 0


def check_devices(node: Node, text: str) -> None:
    """pve-container src/PVE/LXC.pm update_lxc_config: each devN's path must exist on the node
    (`die "Device $absolute_path does not exist\n"`); here under ROOT/node."""
    import re
    for key, value in sorted(config_options(text).items()):
        if re.fullmatch(r"dev\d+", key):
            path = _device_path(value)
            if not node.node_path(path).exists():
                raise PctError(f"Device {path} does not exist\n")


def _check_dev(name: str, value: str) -> None:
    """pve-container's `dev` property string: [path=]/dev/X[,deny-write=0|1][,gid=N][,mode=OCTAL][,uid=N]."""
    import re
    fields = value.split(",")
    if not _device_path(value).startswith("/dev/"):
        raise PctError(f"400 Parameter verification failed.\n{name}: invalid format - {value} is not a device path\n")
    for field_ in fields[1:]:
        key, _, v = field_.partition("=")
        good = {"gid": r"\d+", "uid": r"\d+", "mode": r"0?[0-7]{3}", "deny-write": r"[01]"}.get(key)
        if good is None or not re.fullmatch(good, v):
            raise PctError(f"400 Parameter verification failed.\n{name}: invalid format - {field_}\n")


def _dev_fields(value: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in value.split(",")[1:] if "=" in part)


def _device_path(value: str) -> str:
    """`[path=]/dev/X[,gid=N,mode=M,uid=N,deny-write=1]` -> /dev/X."""
    return value.split(",")[0].removeprefix("path=")


def cmd_stop(node: Node, words: list[str]) -> int:
    (vmid,) = need(words, ["vmid"], "stop")
    check_vmid(vmid)
    node.load_config(vmid)
    if not node.running(vmid):
        raise PctError(f"CT {vmid} not running\n")  # API2/LXC/Status.pm vm_stop
    check_lock(node.conf(vmid).read_text())
    with node.lock(vmid):
        node.set_state(vmid, "stopped")
    return 0


def cmd_shutdown(node: Node, words: list[str]) -> int:
    """`pct shutdown VMID [--timeout S] [--forceStop 0|1]`: a clean stop (the CT's init is asked to
    stop); here the same as stop."""
    positional, _ = split_options(words, {"timeout", "forceStop"})
    return cmd_stop(node, positional)


def cmd_destroy(node: Node, words: list[str]) -> int:
    import shutil
    (vmid,) = need(words, ["vmid"], "destroy")
    check_vmid(vmid)
    with node.lock(vmid):
        check_lock(node.load_config(vmid))
        if node.running(vmid):
            raise PctError(f"unable to destroy CT {vmid} - container is running\n")
        if node.backend(vmid) == "lxc":
            shutil.rmtree(node.lxc_path() / vmid, ignore_errors=True)
            shutil.rmtree(node.ct_root(vmid), ignore_errors=True)
        shutil.rmtree(node.lxc / f"{vmid}.dev", ignore_errors=True)
        node.conf(vmid).unlink()
        (node.lxc / f"{vmid}.state").unlink(missing_ok=True)
    return 0


def cmd_create(node: Node, words: list[str]) -> int:
    """`pct create VMID OSTEMPLATE [--hostname H] [--start 0|1] [--unprivileged 0|1] [--memory MiB]
    [--swap MiB] [--cores N] [--net0 SPEC] [--rootfs STORAGE:GiB] [--mpN SPEC]`.

    Stand-in options (a real node has `apt install` and its storage for these):
    --sim-backend lxc|directory (default directory): a real LXC container, an overlay clone of
    --sim-rootfs DIR (dflash_ops/simnode/rootfs.py), or a directory with its own python;
    --sim-packages a,b,c (default: the trainer's packages; "" for none): what the container's
    python sees besides the stdlib. A directory container's python3 is made from --sim-python
    PATH (default: the interpreter running this stand-in) and the packages are linked into its
    site-packages from this interpreter's installed distributions with everything they require;
    an LXC container gets exactly those files (each top-level module, package and .dist-info of
    the closure) bound read-only into its /usr/local/lib/python3.X/dist-packages, and nothing else
    of this interpreter's (no textual, no fabric, no editable finder of dflash_ops), which needs the
    same python minor version as the rootfs's.
    """
    import json
    mount_points = {f"mp{i}" for i in range(10)}
    positional, opts = split_options(words, {"hostname", "start", "unprivileged", "sim-python", "sim-packages",
                                             "sim-backend", "sim-rootfs", "memory", "swap", "cores", "net0",
                                             "rootfs", *mount_points})
    vmid, template = need(positional, ["vmid", "ostemplate"], "create")
    check_vmid(vmid)
    for name in ("memory", "swap", "cores"):
        if name in opts and not opts[name].isdigit():
            raise PctError(f"400 Parameter verification failed.\n{name}: type check ('integer') failed - got '{opts[name]}'\n")
    backend = opts.get("sim-backend", "directory")
    if backend not in ("lxc", "directory"):
        raise PctError(f"400 Parameter verification failed.\nsim-backend: value '{backend}' does not have a value in the enumeration 'lxc, directory'\n")
    with node.lock(vmid):
        if node.exists(vmid):
            # pve-container src/PVE/API2/LXC.pm create_vm
            raise PctError(f"CT {vmid} already exists on node '{node.nodename()}'\n")
        packages = opts.get("sim-packages")
        names = list(DEFAULT_SIM_PACKAGES) if packages is None else [p for p in packages.split(",") if p]
        ct_root = node.ct_root(vmid)
        hostname = opts.get("hostname") or f"CT{vmid}"  # API2/LXC.pm: hostname defaults to "CT$vmid"
        extra = [f"{k}: {opts[k]}\n" for k in ("memory", "swap", "cores", "net0", *sorted(mount_points)) if k in opts]
        if backend == "lxc":
            rootfs = opts.get("sim-rootfs")
            if not rootfs or not os.path.isfile(os.path.join(rootfs, "sbin", "init.lxc")):
                raise PctError(f"sim-rootfs: no LXC rootfs at {rootfs!r} (run `dflash-ops sim-rootfs`)\n")
            if "sim-python" in opts:
                raise PctError("sim-python: an LXC container runs its rootfs's python3\n")
            node.upper_dir(vmid).mkdir(parents=True, exist_ok=True)
            if names:  # what `apt install python3-torch` would have put there: lxc_config binds it
                _site_packages_for(rootfs)  # the same python minor version, or refused here
                write_atomically(_packages_record(node, vmid), json.dumps(
                    {"names": names, "python": _rootfs_python(rootfs), "files": _package_files(names)}) + "\n")
            # recorded as asked, run privileged: an idmapped CT needs a shifted rootfs (lxc_config)
            unprivileged = _boolean(opts, "unprivileged", True)
            described = f"backend: lxc; rootfs: {rootfs}"
        else:
            python = provision_python(ct_root, opts.get("sim-python") or _base_interpreter(), names)
            unprivileged = _boolean(opts, "unprivileged", True)
            described = f"backend: directory; python: {python}"
        write_atomically(node.conf(vmid), "".join([
            "arch: amd64\n",
            f"hostname: {hostname}\n",
            *extra,
            "ostype: debian\n",
            f"rootfs: {_rootfs_volume(vmid, opts['rootfs']) if 'rootfs' in opts else ct_root}\n",
            f"unprivileged: {int(unprivileged)}\n",
            f"# dflash-ops simulated container from {template}; {described}\n",
        ]))
        write_atomically(node.lxc / f"{vmid}.state", "stopped\n")
        if _boolean(opts, "start", False):
            node.set_state(vmid, "running")
    return 0


def _rootfs_volume(vmid: str, spec: str) -> str:
    """`--rootfs STORAGE:SIZE_GIB` allocates a new volume: recorded as pct does (`local-lvm:vm-500-disk-0,size=8G`);
    the simulated container's files stay under ROOT/ct/VMID."""
    storage, sep, size = spec.partition(":")
    if not sep or not storage or not size.isdigit():
        raise PctError(f"400 Parameter verification failed.\nrootfs: invalid format - unable to parse volume ID '{spec}'\n")
    return f"{storage}:vm-{vmid}-disk-0,size={size}G"


def _rootfs_python(rootfs: str) -> str:
    """The python minor version of a rootfs (Debian bookworm: 3.11)."""
    import re
    from pathlib import Path
    found = sorted(p.name[len("python"):] for p in Path(rootfs, "usr", "bin").glob("python3.*")
                   if re.fullmatch(r"python3\.\d+", p.name))
    if not found:
        raise PctError(f"sim-rootfs: no python3 in {rootfs}\n")
    return found[-1]


def _site_packages_for(rootfs: str) -> str:
    """This interpreter's site-packages, for a container whose python has the same minor version."""
    import site

    if sys.flags.no_site:  # run as `python -I -S` (containers.stand_in_argv): site sets a venv's prefix
        site.main()
    mine = "%d.%d" % sys.version_info[:2]
    theirs = _rootfs_python(rootfs)
    if mine != theirs:
        raise PctError(f"sim-packages need python {theirs} (the rootfs's) to run the stand-in, it runs {mine}\n")
    return site.getsitepackages([sys.prefix])[0]


def _base_interpreter() -> str:
    """The real interpreter behind this one (a venv's python is a link to it)."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    return os.path.realpath(base)


def provision_python(ct_root: Path, base_python: str, packages: list[str]) -> str:
    """CT_ROOT/usr/bin/python3: a real interpreter that sees only the stdlib and `packages`.

    It is a venv (prefix CT_ROOT/usr) made by hand from `base_python`, without the base's
    site-packages; `packages` and everything they require are linked into its site-packages
    from this interpreter's installed distributions, the way `apt install python3-torch`
    fills /usr/lib/python3/dist-packages. Nothing of the operator's venv is visible.
    """
    import subprocess

    base_python = os.path.realpath(base_python)
    # -S: its version only (the site module would add ~35 of the probe's ~50 ms: a venv's .pth files)
    probe = subprocess.run([base_python, "-I", "-S", "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise PctError(f"sim-python {base_python} does not run: {probe.stderr.strip()}\n")
    version = probe.stdout.strip()
    short = ".".join(version.split(".")[:2])
    usr = ct_root / "usr"
    bin_dir = usr / "bin"
    site = usr / "lib" / f"python{short}" / "site-packages"
    site.mkdir(parents=True, exist_ok=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    (usr / "pyvenv.cfg").write_text(
        f"home = {os.path.dirname(base_python)}\n"
        "include-system-site-packages = false\n"
        f"version = {version}\n"
        f"executable = {base_python}\n")
    for name in ("python3", "python", f"python{short}"):
        link = bin_dir / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(base_python if name == "python3" else "python3")
    if packages:
        if short != "%d.%d" % sys.version_info[:2]:
            raise PctError(f"sim-packages need python {sys.version_info[0]}.{sys.version_info[1]} "
                           f"(the stand-in's), sim-python is {short}\n")
        for top, source in _package_files(packages):
            link = site / top
            if not (link.exists() or link.is_symlink()):
                link.symlink_to(source)
    return str(bin_dir / "python3")


def _package_files(names: list[str]) -> list[tuple[str, str]]:
    """(top-level name, path) of every file tree of `names` and their requirements."""
    import re
    if sys.flags.no_site:
        # Run as `python -I -S` (containers.stand_in_argv: every other command starts faster);
        # the distributions to link are in this interpreter's site-packages.
        import site

        site.main()
    from importlib import metadata

    seen: dict[str, metadata.Distribution] = {}
    todo = [(n, True) for n in names]
    while todo:
        name, asked = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if asked:
                raise PctError(f"sim-packages: {name} is not installed for {sys.executable}\n") from None
            continue  # an optional or platform-specific requirement that is not installed
        seen[key] = dist
        for req in dist.requires or []:
            marker = req.partition(";")[2]
            if "extra" in marker:
                continue
            requirement = re.match(r"[A-Za-z0-9._-]+", req)
            if requirement:
                todo.append((requirement.group(), False))
    found: dict[str, str] = {}
    for dist in seen.values():
        for top in _top_levels(dist):
            if top in ("", "/", "..", "__pycache__") or top.endswith(".pth") or top in found:
                continue
            found[top] = str(dist.locate_file(top))
    return sorted(found.items())


def _top_levels(dist: metadata.Distribution) -> set[str]:
    """The first path component of every file a distribution installed.

    Read from its RECORD directly: `dist.files` builds a PackagePath for each of ~30 000 files
    (torch's RECORD alone lists ~20 000), most of what a `pct create` cost.
    """
    record = dist.read_text("RECORD")
    if record is None:  # an egg-info install: dist.files reads installed-files.txt / SOURCES.txt
        return {file.parts[0] for file in dist.files or []}
    import csv

    return {row[0].split("/", 1)[0] for row in csv.reader(record.splitlines()) if row}


# ---------------------------------------------------------------- the LXC backend
# A container created with `--sim-backend lxc` is a real LXC container (lxc 5, privileged): an
# overlay clone of one cached Debian rootfs (--sim-rootfs; dflash_ops/simnode/rootfs.py builds
# it), its upper directory CT_ROOT/delta0, its LXC config lxc_path()/VMID/config written from the
# Proxmox-style config at every start (as pve-container's update_lxc_config does), started with
# LXC's init.lxc, commands through lxc-attach, push/pull in its mount namespace.

CLONE_NEWNS = 0x00020000
SIM_APT_REPO = "/srv/dflash-sim-apt"  # aptrepo.REPO_DIR (this file is stdlib-only and imports nothing of ours)
MIB = 1 << 20


def _lxc_tool(name: str) -> str:
    import shutil
    tool = shutil.which(name)
    if tool is None:
        raise PctError(f"{name} not found: install lxc\n")
    return tool


def lxc_init_pid(node: Node, vmid: str) -> int | None:
    """The host pid of the container's init, None when it is not running."""
    import subprocess

    proc = subprocess.run([_lxc_tool("lxc-info"), "-P", str(node.lxc_path()), "-n", vmid, "-p", "-H"],
                          capture_output=True, text=True)
    text = proc.stdout.strip()
    return int(text) if proc.returncode == 0 and text.isdigit() else None


def lxc_set_state(node: Node, vmid: str, state: str) -> None:
    import subprocess

    lxcpath = str(node.lxc_path())
    if state == "running":
        write_atomically(node.lxc_path() / vmid / "config", lxc_config(node, vmid))
        log = node.ct_root(vmid) / "lxc.log"
        proc = subprocess.run([_lxc_tool("lxc-start"), "-P", lxcpath, "-n", vmid, "-d", "-o", str(log), "-l", "ERROR"],
                              capture_output=True, text=True)
        pid = lxc_init_pid(node, vmid)
        if proc.returncode != 0 or pid is None:
            # pve-container src/PVE/LXC.pm vm_start: die "startup for container '$vmid' failed\n"
            detail = (proc.stderr.strip() or _tail(log)).replace("\n", "; ")
            raise PctError(f"startup for container '{vmid}' failed\n{detail}\n")
        if "net0" not in config_options(node.conf(vmid).read_text()):
            _loopback_up(pid)
    else:
        subprocess.run([_lxc_tool("lxc-stop"), "-P", lxcpath, "-n", vmid, "-k"], capture_output=True)


CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def _loopback_up(init_pid: int) -> None:
    """Bring up `lo` in the network namespace of a container without net0 (lxc.net.0.type empty).

    LXC creates it down, and LXC's static init brings up nothing; on a node the CT's own init
    does (Debian's ifupdown: `auto lo` in the /etc/network/interfaces pve-container writes), so
    a service in the CT answers on 127.0.0.1. A forked child enters the namespace (setns), as
    push/pull enter the mount namespace, and sets IFF_UP (SIOCSIFFLAGS: no `ip` needed here or
    in the CT)."""
    import socket
    import struct

    def up() -> None:
        with open(f"/proc/{init_pid}/ns/net", "rb") as ns:
            _setns(ns.fileno(), CLONE_NEWNET)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            flags = struct.unpack_from("H", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0)), 16)[0]
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))

    if not _in_forked_child(up, "container loopback: "):
        raise PctError(f"startup for container: cannot bring up its loopback (pid {init_pid})\n")


def _in_forked_child(fn: "Callable[[], None]", prefix: str = "") -> bool:
    """fn() in a forked child, which may enter a container's namespaces (setns) without this
    process leaving its own; an exception is printed (after `prefix`). True when fn returned."""
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            fn()
            code = 0
        except Exception as e:  # noqa: BLE001 - the child's failure, printed; the parent decides
            sys.stderr.write(f"{prefix}{e}\n")
        finally:
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(child, 0)
    return status == 0


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-1000:]
    except OSError:
        return ""


def _raw_lxc(text: str) -> list[tuple[str, str]]:
    import re
    found = []
    for line in text.splitlines():
        if line.startswith("["):
            break
        raw = re.match(r"^(lxc\.[a-z0-9_\-.]+)(:|\s*=)\s*(.*?)\s*$", line)
        if raw:
            found.append((raw.group(1), raw.group(3)))
    return found


# cgroup v2 keys (what Proxmox writes) and their cgroup v1 names, for a host whose controllers are v1.
CGROUP2_TO_V1 = {"memory.max": "memory.limit_in_bytes", "pids.max": "pids.max",
                 "devices.allow": "devices.allow", "devices.deny": "devices.deny",
                 "cpuset.cpus": "cpuset.cpus"}


def _cgroup_v1() -> bool:
    return os.path.isdir("/sys/fs/cgroup/memory")


def lxc_config(node: Node, vmid: str) -> str:
    """The LXC config of a container from its Proxmox-style config (pve-container's update_lxc_config)."""
    import re
    text = node.conf(vmid).read_text()
    options = config_options(text)
    rootfs = re.search(r"^# dflash-ops .*; rootfs: (\S+)", text, re.M)
    if not rootfs:
        raise PctError(f"container {vmid}: no rootfs recorded\n")
    upper = node.upper_dir(vmid)
    upper.mkdir(parents=True, exist_ok=True)
    v1 = _cgroup_v1()
    prefix = "lxc.cgroup." if v1 else "lxc.cgroup2."
    lines = [
        f"lxc.uts.name = {options.get('hostname', f'CT{vmid}')}",
        f"lxc.rootfs.path = overlay:{rootfs.group(1)}:{upper}",
        f"lxc.init.cmd = /sbin/init.lxc -n {vmid} -- /bin/sleep infinity",
        # no net0: only loopback, as a CT without one; with one: the node's network (no bridge here)
        f"lxc.net.0.type = {'none' if 'net0' in options else 'empty'}",
        "lxc.mount.auto = proc:mixed sys:mixed cgroup:mixed:force",
        "lxc.autodev = 1",
        "lxc.tty.max = 0",
        "lxc.pty.max = 16",
        # a Proxmox CT's /dev/shm: a tmpfs of its own, charged to its memory cgroup
        "lxc.mount.entry = tmpfs dev/shm tmpfs rw,nosuid,nodev,create=dir 0 0",
        "lxc.cgroup.relative = 1",  # under the caller's cgroup, not the machine's root
        "lxc.apparmor.profile = unconfined",
    ]
    if "memory" in options:  # pve-container: memory (MiB) -> memory.max; swap -> memory.swap.max
        memory = int(options["memory"]) * MIB
        lines.append(f"{prefix}{'memory.limit_in_bytes' if v1 else 'memory.max'} = {memory}")
        swap = int(options.get("swap", "0")) * MIB
        if v1 and os.path.exists("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes"):
            lines.append(f"lxc.cgroup.memory.memsw.limit_in_bytes = {memory + swap}")
        elif not v1:
            lines.append(f"lxc.cgroup2.memory.swap.max = {swap}")
    if "cores" in options:
        cores = min(int(options["cores"]), os.cpu_count() or 1)
        lines.append(f"{prefix}cpuset.cpus = {'0' if cores == 1 else f'0-{cores - 1}'}")
    for key in sorted(k for k in options if re.fullmatch(r"mp\d+", k)):
        # mpN: SOURCE,mp=PATH[,ro=1]: a bind mount of a node directory (pve-container mountpoints)
        parts = options[key].split(",")
        fields = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        flags = "bind,ro" if fields.get("ro") == "1" else "bind"
        lines.append(f"lxc.mount.entry = {parts[0]} {fields['mp'].lstrip('/')} none {flags},create=dir 0 0")
    mirror = node.node_path(SIM_APT_REPO)
    if mirror.is_dir():  # the node's apt repository (simnode/aptrepo.py), as a site mirror containers reach
        lines.append(f"lxc.mount.entry = {mirror} {SIM_APT_REPO.lstrip('/')} none bind,ro,create=dir 0 0")
    for top, source in _packages_to_bind(node, vmid):
        kind = "dir" if os.path.isdir(source) else "file"
        lines.append(f"lxc.mount.entry = {source} {top} none bind,ro,create={kind} 0 0")
    for key in sorted((k for k in options if re.fullmatch(r"dev\d+", k)), key=lambda k: int(k[3:])):
        # devN: pve-container's autodev hook makes the node with the entry's uid, gid and mode (else
        # root:root 0660); here a file of the container's own with them, a copy of the node's, is bound
        path = _device_path(options[key])
        lines.append(f"lxc.mount.entry = {_device_node(node, vmid, path, _dev_fields(options[key]))} "
                     f"{path.lstrip('/')} none bind,create=file 0 0")
    for key, value in _raw_lxc(text):
        if key == "lxc.idmap":  # runs privileged: the map is recorded, not applied (docs/simulated-node.md)
            continue
        if key.startswith("lxc.prlimit."):
            value = _prlimit_here(key[len("lxc.prlimit."):], value)
        if key.startswith("lxc.cgroup2.") and v1:  # Proxmox writes cgroup v2 keys; this host has v1
            name = key[len("lxc.cgroup2."):]
            if name in CGROUP2_TO_V1:
                lines.append(f"lxc.cgroup.{CGROUP2_TO_V1[name]} = {value}")
            continue
        lines.append(f"{key} = {value}")
    return "".join(line + "\n" for line in lines)


def _packages_record(node: Node, vmid: str) -> Path:
    return node.ct_root(vmid) / "sim-packages.json"


def _packages_to_bind(node: Node, vmid: str) -> list[tuple[str, str]]:
    """(path in the container, path here) of each file tree of the container's packages (its
    create's --sim-packages and what they require). A record whose files are gone (the venv that
    created the container was removed) is made again from this interpreter's distributions, as an
    admin would reinstall the packages."""
    import json
    record_path = _packages_record(node, vmid)
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        return []
    files = record.get("files") or []
    if any(not os.path.exists(source) for _, source in files):
        files = _package_files(list(record.get("names") or []))
        write_atomically(record_path, json.dumps({**record, "files": files}) + "\n")
    site = f"usr/local/lib/python{record.get('python', '3')}/dist-packages"
    return [(f"{site}/{top}", source) for top, source in files]


def _device_node(node: Node, vmid: str, path: str, fields: dict[str, str]) -> Path:
    """The container's device node `path` as pve-container makes it from a devN entry: owner
    uid (default 0), group gid (default 0), mode (default 0660), a node's own file under
    ROOT/lxc/VMID.dev/ (the node's fixture is a plain file, so nothing opens it as a GPU)."""
    if not node.node_path(path).exists():
        raise PctError(f"Device {path} does not exist\n")
    made = node.lxc / f"{vmid}.dev" / path.lstrip("/").replace("/", "_")
    made.parent.mkdir(parents=True, exist_ok=True)
    made.touch()
    os.chown(made, int(fields.get("uid", "0")), int(fields.get("gid", "0")))
    os.chmod(made, int(fields.get("mode", "0660"), 8))
    return made


def _prlimit_here(name: str, value: str) -> str:
    """An lxc.prlimit.NAME value this machine can set: a node's root raises any limit, but this
    machine may itself be a container whose hard limit (memlock: 8 MiB) even root cannot pass
    (lxc-start then aborts: "Failed to set limit memlock"); such a value becomes the hard limit."""
    import resource

    which = getattr(resource, f"RLIMIT_{name.upper()}", None)
    if which is None:
        return value
    hard = resource.getrlimit(which)[1]
    if hard == resource.RLIM_INFINITY:
        return value
    words = value.split(":")
    capped = [str(hard) if w == "unlimited" or (w.isdigit() and int(w) > hard) else w for w in words]
    return ":".join(capped)


_libc = None


def _setns(fd: int, nstype: int = CLONE_NEWNS) -> None:
    global _libc
    import ctypes

    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def in_container(node: Node, vmid: str, worker: "Callable[[Callable[[], None], Callable[[], None]], None]") -> None:
    """Run a push/pull worker: worker(node_side, ct_side), each entering where that side's path is.

    A directory container's paths are the node's; an LXC container's are in its mount namespace,
    which a forked worker enters (setns), as pct's worker does, and leaves again for the node's side.
    """
    if node.backend(vmid) != "lxc":
        worker(lambda: None, lambda: None)
        return
    pid = lxc_init_pid(node, vmid)
    if pid is None:
        raise PctError(f"container '{vmid}' not running!\n")
    ct_ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
    node_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY)
    cwd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)

    def node_side() -> None:
        _setns(node_ns)
        os.fchdir(cwd)

    def ct_side() -> None:
        _setns(ct_ns)

    _in_forked_child(lambda: worker(node_side, ct_side))  # a worker's die is printed; pct still exits 0
    for fd in (ct_ns, node_ns, cwd):
        os.close(fd)


# ---------------------------------------------------------------- pct config
# A simulated container's config is ROOT/lxc/<vmid>.conf, written by `pct create` in the format
# of /etc/pve/lxc/<vmid>.conf (tests append lxc.* / devN entries to give a CT GPUs).


def format_config(text: str) -> str:
    """What pct.pm's `config` prints for a config file: options sorted by key (digest left out),
    then the raw lxc.* keys in file order. Only the current section is read ([snapshot] and
    [pve:pending] sections are not); '#' description lines are not printed."""
    import re
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
    text = node.load_config(vmid)
    if "snapshot" in opts:
        raise PctError(f"snapshot '{opts['snapshot']}' does not exist\n")
    sys.stdout.write(format_config(text))
    return 0


SET_OPTIONS = {"hostname", "memory", "swap", "cores", "net0", "onboot", "description", "features",
               *(f"mp{i}" for i in range(10)), *(f"dev{i}" for i in range(256))}


def cmd_set(node: Node, words: list[str]) -> int:
    """`pct set VMID [--devN SPEC] [--memory MiB] [--cores N] [--swap MiB] [--hostname H] [--mpN SPEC]
    [--net0 SPEC] [--onboot 0|1] [--delete KEYS]`: the config rewritten under the config lock the way
    pve-container's write_pct_config writes it (API2/LXC/Config.pm update_vm -> PVE::LXC::Config
    update_pct_config): '#' description lines first, then the options sorted by key, then the raw
    lxc.* lines in their order as `key: value`, then the snapshot sections as they were. A comment
    line anywhere in the file is description, so it moves to the top: nothing can mark a line by a
    comment beside it. A running container takes the change into its config (no pending section)."""
    import re
    positional, opts = split_options(words, SET_OPTIONS | {"delete"})
    (vmid,) = need(positional, ["vmid"], "set")
    check_vmid(vmid)
    for name in ("memory", "swap", "cores"):
        if name in opts and not opts[name].isdigit():
            raise PctError(f"400 Parameter verification failed.\n{name}: type check ('integer') failed - got '{opts[name]}'\n")
    for name, value in opts.items():
        if re.fullmatch(r"dev\d+", name):
            _check_dev(name, value)
        if name == "features" and not re.fullmatch(r"(?:(?:nesting|keyctl|fuse|mknod|force_rw_sys)=[01],?)+", value):
            raise PctError(f"400 Parameter verification failed.\nfeatures: invalid format - {value}\n")
    if not opts:
        raise PctError("400 no options specified\n")  # API2/LXC/Config.pm update_vm
    with node.lock(vmid):
        text = node.load_config(vmid)
        check_lock(text)
        deleted = [k for k in re.split(r"[,;\s]+", opts.pop("delete", "")) if k]
        for key in deleted:
            if key in opts:
                raise PctError(f"unable to delete parameter '{key}' - parameter is also set\n")
        write_atomically(node.conf(vmid), rewrite_config(text, opts, deleted))
    return 0


def rewrite_config(text: str, changes: dict[str, str], deleted: "list[str] | tuple[str, ...]" = ()) -> str:
    """parse_pct_config + write_pct_config of the current section, with `changes` set and `deleted` removed."""
    import re
    head, sep, rest = text.partition("\n[")
    description, options, lxc = [], {}, []
    for line in head.splitlines():
        if line.startswith("#"):
            description.append(line)
        elif not line.strip():
            continue
        elif (raw := re.match(r"^(lxc\.[a-z0-9_\-.]+)(:|\s*=)\s*(.*?)\s*$", line)):
            lxc.append((raw.group(1), raw.group(3)))
        else:
            key, _, value = line.partition(":")
            options[key.strip()] = value.strip()
    for key in deleted:
        options.pop(key, None)
    options.update(changes)
    out = "".join(line + "\n" for line in description)
    out += "".join(f"{k}: {options[k]}\n" for k in sorted(options))
    out += "".join(f"{k}: {v}\n" for k, v in lxc)
    return out + ("\n[" + rest if sep else "")


COMMANDS = {
    "create": cmd_create,
    "set": cmd_set,
    "exec": cmd_exec,
    "push": cmd_push,
    "pull": cmd_pull,
    "status": cmd_status,
    "list": cmd_list,
    "start": cmd_start,
    "stop": cmd_stop,
    "shutdown": cmd_shutdown,
    "destroy": cmd_destroy,
    "config": cmd_config,
}


def node_root_uid(root: str | os.PathLike[str]) -> int:
    """The simulated node's root: whoever owns its state root (made by the first caller)."""
    try:
        return os.stat(root).st_uid
    except FileNotFoundError:
        return os.geteuid()
    except OSError:
        return 0  # cannot even look: only root is root


def main(args: list[str]) -> int:
    root = os.environ.get("DFLASH_OPS_SIM_ROOT", "~/.local/state/dflash-ops/sim")
    if args[:1] == ["--state-root"] and len(args) >= 2:
        root, args = args[1], args[2:]
    node = Node(os.path.expanduser(root))
    if not args or args[0] not in COMMANDS:
        shown = f"pct {args[0]}" if args else "pct"
        # pve-common src/PVE/CLIHandler.pm handle_cmd: $abort->("unknown command '$cmd_str'")
        sys.stderr.write(f"ERROR: unknown command '{shown}'\n{USAGE}\n")
        return 255
    # pve-common src/PVE/RESTEnvironment.pm setup_default_cli_env, run before every command.
    if os.geteuid() not in (0, node_root_uid(node.top)):
        sys.stderr.write("please run as root\n")
        return 255
    try:
        return COMMANDS[args[0]](node, args[1:])
    except PctError as e:
        sys.stderr.write(str(e))
        return 255


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
