"""Start a throw-away OpenSSH sshd on 127.0.0.1 whose `pct` is the stand-in (integration tier, bench).

    node = start_sshd(workdir)         # generated host + client keys, known_hosts, inventory
    load_inventory(node.inventory)     # target host200 (ctid 200) on node 'sshd' over real SSH
    node.stop()

Requirements: /usr/sbin/sshd and ssh-keygen. sshd sanitises the session environment, so the
node's pct is an absolute-path wrapper script that runs the stand-in by file path with this
interpreter (the stand-in is stdlib only and needs no PYTHONPATH). As root, sshd gets the node's
own login ~/.bashrc (Debian's default) instead of this machine's: see _node_login_rc.

The many-node tier (dflash_ops.testing.netns) starts one of these per network namespace:
`start_sshd(workdir, address=IP, port=22, netns=NAME, node_name=...)`.
"""

from __future__ import annotations

import getpass
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_ops.simnode import containers as simct
from dflash_ops.simnode.pct import write_atomically as _write
from trainer.run import yamlsafe

SSHD = "/usr/sbin/sshd"
# What base-files installs as /root/.bashrc on Debian, so on a fresh Proxmox VE node.
NODE_BASHRC = Path("/usr/share/base-files/dot.bashrc")


def sshd_unavailable_reason() -> str | None:
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} not found (install openssh-server)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen not found (install openssh-client)"
    return None


@dataclass
class SshdNode:
    workdir: Path
    port: int
    user: str
    inventory: Path  # inventory file: node 'sshd' (node_name), target 'host200' (ctid 200)
    known_hosts: Path
    client_key: Path
    host_key: Path
    sim_root: Path
    base_dir: Path
    log: Path
    proc: subprocess.Popen
    ctids: tuple[int, ...] = field(default=(200,))
    address: str = "127.0.0.1"
    netns: str | None = None  # the network namespace sshd listens in (None: this one)
    config: Path | None = None
    pct: Path | None = None  # the node's pct wrapper script
    node_name: str = "sshd"
    pct_prefix: tuple[str, ...] = ()  # ("sudo", "-n") for a sudo-pct node with a non-root login
    cleanup: list = field(default_factory=list)  # undone by close(): a sudo login's user, sudoers entry, keys
    login_rc: tuple[Path, Path] | None = None  # (node's ~/.bashrc, bound over this one): _node_login_rc

    def node_entry(self) -> dict:
        """This node as an inventory `nodes:` entry (real SSH, strict host keys)."""
        return {
            "transport": "ssh", "address": self.address, "port": self.port, "user": self.user,
            "identity_file": str(self.client_key), "known_hosts": str(self.known_hosts),
            "strict_host_key_checking": True, "pct": [*self.pct_prefix, str(self.pct)],
        }

    def container_base(self, ctid: int) -> Path:
        return self.workdir / f"ct{ctid}" / "opt" / "dflash"

    def target_entry(self, ctid: int) -> dict:
        """Container `ctid` of this node as an inventory `targets:` entry."""
        return {"node": self.node_name, "ctid": ctid, "base_dir": str(self.container_base(ctid)),
                "python": self.container_python(ctid), "gpus": []}

    def container_python(self, ctid: int) -> str:
        """The container's own python (pct create made it; not on pct's PATH: name it as `python:`)."""
        return simct.container_python(self.sim_root, ctid)

    def host_key_line(self, address: str, port: int) -> str:
        """A known_hosts line for this node's host key reached as address:port."""
        host = address if port == 22 else f"[{address}]:{port}"
        key_type, key = (self.workdir / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        return f"{host} {key_type} {key}\n"

    def listening(self) -> bool:
        return self.proc.poll() is None

    def start(self) -> None:
        """Start the listener again (after stop()): same port, keys and state."""
        if self.listening():
            return
        assert self.config is not None, "a node from start_sshd() has its sshd_config"
        self.proc = _launch(self.config, self.log, self.netns, self.login_rc)
        try:
            _wait_for_banner(self.address, self.port, self.proc, self.log)
        except BaseException:
            self.stop()
            raise

    def accepted_logins(self) -> int:
        """SSH connections authenticated so far (sshd logs one 'Accepted publickey' line each)."""
        return self.log.read_text(errors="replace").count("Accepted publickey")

    def session_pids(self) -> list[int]:
        """Per-connection sshd processes (children of the listener)."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid:
                pids.append(int(stat.parent.name))
        return pids

    def kill_sessions(self) -> int:
        """SIGKILL every per-connection sshd process, dropping all client connections."""
        pids = self.session_pids()
        kill_all(pids)
        return len(pids)

    def stop(self) -> None:
        """The listener and every session go away (connections drop; new ones are refused)."""
        self.kill_sessions()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        """stop(), stop its LXC containers, and remove what start_sshd set up outside workdir (a sudo
        login, its keys dir)."""
        self.stop()
        simct.stop_all(self.sim_root, ["ip", "netns", "exec", self.netns] if self.netns else ())
        while self.cleanup:
            self.cleanup.pop()()


def kill_all(pids: list[int]) -> None:
    """SIGKILL each of `pids` (processes the test tier started); one already gone is fine."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def sudo_login_unavailable_reason() -> str | None:
    """Why a `sudo pct` node with a non-root login cannot be set up here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (creates a login user and a sudoers entry)"
    for tool in ("sudo", "useradd", "userdel", "visudo"):
        if shutil.which(tool) is None:
            return f"{tool} not found (install sudo / passwd)"
    return None


def _add_sudo_login(name: str, pct_wrapper: Path, cleanup: list) -> None:
    """A throw-away non-root login that may run exactly `sudo -n PCT_WRAPPER ...` as root."""
    if subprocess.run(["id", "-u", name], capture_output=True).returncode != 0:
        # "*": no password, but not locked ("!"), which sshd refuses without PAM
        subprocess.run(["useradd", "--no-create-home", "--home-dir", "/", "--shell", "/bin/sh", "--password", "*",
                        name], check=True)
        cleanup.append(lambda: subprocess.run(["userdel", name], capture_output=True))
    entry = Path(f"/etc/sudoers.d/dflash-ops-test-{name}")
    text = f"{name} ALL=(root) NOPASSWD: {pct_wrapper}\n"
    tmp = entry.with_name(entry.name + ".tmp")  # sudo ignores names with a dot
    tmp.write_text(text)
    os.chmod(tmp, 0o440)
    subprocess.run(["visudo", "-c", "-q", "-f", str(tmp)], check=True)
    os.replace(tmp, entry)
    cleanup.append(lambda: entry.unlink(missing_ok=True))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


def _wait_for_banner(address: str, port: int, proc: subprocess.Popen, log: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited with {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        try:
            with socket.create_connection((address, port), timeout=1) as s:
                if s.recv(4).startswith(b"SSH-"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"sshd did not answer on port {port}: {log.read_text(errors='replace')[-2000:]}")


def _node_login_rc(workdir: Path, user: str) -> tuple[Path, Path] | None:
    """(the node's ~/.bashrc, this machine's) when sshd must run with the node's own.

    sshd runs each command as `$SHELL -c COMMAND`, and Debian's bash then reads ~/.bashrc
    (bash's SSH_SOURCE_BASHRC). The simulated node logs into this machine's account, whose
    ~/.bashrc is this machine's: here `pyenv init` (about 100 processes, ~0.13 s of CPU for
    every command) where a Proxmox node has Debian's default. As root, sshd runs in its own
    mount namespace with the node's file (NODE_BASHRC, else empty) bound over it; otherwise
    the login's own file stays (and is paid for on every command).
    """
    import pwd

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return None
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return None
    here = Path(entry.pw_dir) / ".bashrc"
    if os.path.basename(entry.pw_shell) != "bash" or not here.is_file():
        return None
    node_rc = workdir / "node.bashrc"
    _write(node_rc, NODE_BASHRC.read_text() if NODE_BASHRC.is_file() else "", mode=0o644)
    return node_rc, here


def _launch(config: Path, log: Path, netns: str | None, login_rc: tuple[Path, Path] | None = None) -> subprocess.Popen:
    argv = [SSHD, "-D", "-e", "-f", str(config)]
    if login_rc is not None:  # unshare and sh exec: the Popen pid is still sshd's
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount --bind "$1" "$2" && shift 2 && exec "$@"', "node-login", *map(str, login_rc), *argv]
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]  # ip execs sshd: the Popen pid is sshd's
    with open(log, "ab") as log_file:
        return subprocess.Popen(argv, stdout=log_file, stderr=log_file, stdin=subprocess.DEVNULL)


def start_sshd(
    workdir: Path,
    ctids: tuple[int, ...] = (200,),
    *,
    address: str = "127.0.0.1",
    port: int | None = None,
    netns: str | None = None,
    node_name: str = "sshd",
    sudo_login: str | None = None,
) -> SshdNode:
    """sshd on address:port (a free port on 127.0.0.1 by default), optionally inside `netns`.

    With `sudo_login`, the node is reached as that throw-away non-root user, whose inventory
    runs `sudo -n pct` (the user and its sudoers entry are removed by close()).
    """
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    reason = sshd_unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    host_key, client_key = workdir / "ssh_host_ed25519_key", workdir / "client_ed25519_key"
    for key in (host_key, client_key):
        if not key.exists():
            _keygen(key)
    cleanup: list = []
    # sshd reads the keys file as the login user: a non-root one cannot reach a root-only workdir.
    keys_dir = Path(tempfile.mkdtemp(prefix="dflash-ops-sshd-keys-"))
    os.chmod(keys_dir, 0o755)
    cleanup.append(lambda: shutil.rmtree(keys_dir, ignore_errors=True))
    authorized_keys = keys_dir / "authorized_keys"
    _write(authorized_keys, (workdir / "client_ed25519_key.pub").read_text(), mode=0o644)
    port = port or _free_port()
    user = sudo_login or getpass.getuser()
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)
    config = workdir / "sshd_config"
    _write(config, "\n".join([
        f"Port {port}",
        f"ListenAddress {address}",
        f"HostKey {host_key}",
        f"AuthorizedKeysFile {authorized_keys}",
        f"PidFile {workdir / 'sshd.pid'}",
        "UsePAM no",
        "StrictModes no",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",
        f"AllowUsers {user}",
        "Subsystem sftp internal-sftp",
        "MaxSessions 64",
        "MaxStartups 64",
        "LogLevel VERBOSE",
        "",
    ]), mode=0o600)
    sim_root = workdir / "sim"
    backend = simct.pick_backend()
    for ctid in ctids:  # the containers exist because the node's admin created them
        if not simct.is_created(sim_root, ctid):
            # An LXC container sees its test directory WORKDIR/ct<ctid> (its base_dir's) at the same
            # path; a node in a network namespace creates (so starts) it there, with a net0: it
            # shares the node's network, where the other nodes' ranks reach it.
            simct.create(sim_root, ctid, hostname=f"host{ctid}", backend=backend,
                         binds=[str(workdir / f"ct{ctid}")] if backend == "lxc" else (),
                         network=netns is not None, prefix=["ip", "netns", "exec", netns] if netns else ())
    bin_dir = workdir / "bin"
    bin_dir.mkdir(exist_ok=True)
    pct = bin_dir / "pct"
    _write(pct, "#!/bin/sh\nexec " + shlex.join(simct.stand_in_argv(sim_root)) + ' "$@"\n', mode=0o755)
    pct_prefix: tuple[str, ...] = ()
    if sudo_login:
        _add_sudo_login(sudo_login, pct, cleanup)
        pct_prefix = ("sudo", "-n")
    log = workdir / "sshd.log"
    login_rc = _node_login_rc(workdir, user)
    proc = _launch(config, log, netns, login_rc)
    node = SshdNode(workdir=workdir, port=port, user=user, inventory=workdir / "inventory.yaml",
                    known_hosts=workdir / "known_hosts", client_key=client_key, host_key=host_key,
                    sim_root=sim_root, base_dir=workdir / "ct200" / "opt" / "dflash", log=log,
                    proc=proc, ctids=tuple(ctids), address=address,
                    netns=netns, config=config, pct=pct, node_name=node_name,
                    pct_prefix=pct_prefix, cleanup=cleanup, login_rc=login_rc)
    _write(node.known_hosts, node.host_key_line(address, port), mode=0o600)
    targets = {f"host{ctid}": node.target_entry(ctid) for ctid in ctids}
    _write(node.inventory, yamlsafe.dump({"nodes": {node_name: node.node_entry()}, "targets": targets}), mode=0o644)
    try:
        _wait_for_banner(address, port, proc, log)
    except BaseException:
        node.close()
        raise
    return node
