"""Many Proxmox nodes on this machine: one network namespace each (fault tier, fleet bench,
multi-node runs). Needs root, `ip` and `tc` (iproute2) and OpenSSH's sshd.

    fleet = start_fleet(workdir, nodes=4, ctids=(200, 201))
    fleet.inventory               # nodes n0..n3 (a real sshd each), targets n0-200, n0-201, n1-200, ...
    node = fleet.nodes[1]         # fleet.node("n1") / fleet.target_node("n1-200") also work
    node.address                  # its own IPv4 address: reachable from here and from every node
    node.run(["hostname", "-I"])  # a command inside its namespace (subprocess.run keywords)
    node.partition(20)            # link down for 20 s (background; node.heal() ends it early):
    with node.partitioned(): ...  #   packets vanish, connects time out - not a missing route
    node.limit_bandwidth("1mbit") # tc tbf, both directions; node.unlimit()
    node.kill_sshd(); node.start_sshd()
    node.fill_disk(); node.free_disk()   # with start_fleet(disk_mb=N): each container dir is a tmpfs
    fleet.with_latency(0.1)       # an inventory reaching every node through a delaying relay (+100 ms RTT)
    fleet.close()                 # kills what it started; removes namespaces, veths, bridge, mounts

Layout: a bridge in this (the operator's) namespace holds 10.A.B.1/24; node i is 10.A.B.(10+i)
on its own veth pair, so nodes reach each other directly over the bridge (for torch.distributed,
gloo between ranks). Neighbour entries are permanent, so a node whose link is down is silent
(SYNs vanish) instead of answering "no route to host" once ARP gives up. Names carry the pid
and a per-process counter, so concurrent test sessions never collide; a fleet left behind by a
killed session (its pid gone) is removed by the next start_fleet.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from dflash_ops.testing.sshd import SshdNode, kill_all, sshd_unavailable_reason, start_sshd
from trainer.run import yamlsafe

NETNS_PREFIX = "dflash-"  # namespaces: dflash-<pid>x<k>-n<i>
LINK_PREFIX = "dfb"  # bridges: dfb<pid>x<k>; veths: dfv<pid>x<k>n<i>
_counter = itertools.count()


def netns_unavailable_reason() -> str | None:
    """Why the tier cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "the netns tier needs root (network namespaces, veth, tc, tmpfs mounts)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("mount", "mount")):
        if shutil.which(tool) is None:
            return f"{tool} not found (install {package})"
    reason = sshd_unavailable_reason()
    if reason:
        return reason
    probe = f"{NETNS_PREFIX}{os.getpid()}probe"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"cannot create a network namespace: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _ip(*args: str, netns: str | None = None, check: bool = True, tool: str = "ip") -> subprocess.CompletedProcess:
    """`ip ARGS` (or `tc ARGS`), in `netns` when given; RuntimeError with its stderr when it fails."""
    argv = [tool, *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done


@dataclass
class FleetNode:
    """One Proxmox node: a namespace, an address, an sshd, pct stand-in state, containers."""

    name: str
    netns: str
    address: str
    mac: str
    veth: str  # the operator-side end of its veth pair (on the bridge); the node side is eth0
    sshd: SshdNode
    ctids: tuple[int, ...]
    fleet: "Fleet" = field(repr=False)
    disk_mounts: list[Path] = field(default_factory=list)
    link_down: bool = False
    limited: bool = False
    _heal_timer: threading.Timer | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- inside the node ------------------------------------------------------------------
    def argv(self, argv: list[str]) -> list[str]:
        """`argv` run inside this node's network namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), **kwargs)

    def target_names(self) -> list[str]:
        return [f"{self.name}-{ctid}" for ctid in self.ctids]

    def base_dir(self, ctid: int) -> Path:
        """The container's base_dir (its files are visible from here: the stand-in's containers are dirs)."""
        return self.sshd.container_base(ctid)

    # -- faults ---------------------------------------------------------------------------
    def partition(self, seconds: float | None = None) -> None:
        """Take the node's link down (for `seconds`, then heal, in the background)."""
        with self._lock:
            self._cancel_timer()
            _ip("link", "set", "eth0", "down", netns=self.netns)
            self.link_down = True
            if seconds is not None:
                self._heal_timer = threading.Timer(seconds, self.heal)
                self._heal_timer.daemon = True
                self._heal_timer.start()

    def heal(self) -> None:
        with self._lock:
            self._cancel_timer()
            if not self.link_down:
                return
            _ip("link", "set", "eth0", "up", netns=self.netns)
            self.fleet._pin_neighbours(self)  # admin-down flushed the node's own entries
            self.link_down = False

    def _cancel_timer(self) -> None:
        if self._heal_timer is not None and self._heal_timer is not threading.current_thread():
            self._heal_timer.cancel()
        self._heal_timer = None

    @property
    def partitioned_now(self) -> bool:
        """Is the link down right now (as the kernel says)?"""
        out = _ip("-j", "link", "show", "eth0", netns=self.netns).stdout
        return "UP" not in json.loads(out)[0]["flags"]

    @contextmanager
    def partitioned(self) -> Iterator[FleetNode]:
        self.partition()
        try:
            yield self
        finally:
            self.heal()

    def limit_bandwidth(self, rate: str = "1mbit", burst: str = "32kb", latency: str = "400ms") -> None:
        """tc tbf on both ends of the node's link: traffic to and from the node is limited to `rate`."""
        for dev, netns in ((self.veth, None), ("eth0", self.netns)):
            _ip("qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency", latency,
                netns=netns, tool="tc")
        self.limited = True

    def unlimit(self) -> None:
        if self.limited:
            for dev, netns in ((self.veth, None), ("eth0", self.netns)):
                _ip("qdisc", "del", "dev", dev, "root", netns=netns, check=False, tool="tc")
            self.limited = False

    def kill_sshd(self) -> None:
        """The node's sshd goes away: sessions drop, new connections are refused."""
        self.sshd.stop()

    def start_sshd(self) -> None:
        self.sshd.start()

    def fill_disk(self, ctid: int | None = None) -> None:
        """Fill the containers' disks (tmpfs, start_fleet(disk_mb=...)) until writes fail ENOSPC."""
        if not self.disk_mounts:
            raise RuntimeError(f"{self.name}: started without disk_mb, there is no small disk to fill")
        for ctid_, mount in zip(self.ctids, self.disk_mounts):
            if ctid in (None, ctid_):
                with open(mount / ".filler", "ab", buffering=0) as filler:
                    for size in (1 << 20, 4096, 1):
                        try:
                            while filler.write(b"\0" * size):
                                pass
                        except OSError:  # ENOSPC: on to the next smaller size
                            pass

    def free_disk(self) -> None:
        for mount in self.disk_mounts:
            (mount / ".filler").unlink(missing_ok=True)


@dataclass
class Fleet:
    workdir: Path
    tag: str
    bridge: str
    subnet: str  # e.g. "10.213.7"
    nodes: list[FleetNode] = field(default_factory=list)
    inventory: Path | None = None
    processes: list[subprocess.Popen] = field(default_factory=list)
    closed: bool = False
    node_settings: dict = field(default_factory=dict)
    bridge_mac: str = ""  # known once every node is on the bridge

    def node(self, name: str) -> FleetNode:
        return next(n for n in self.nodes if n.name == name)

    def target_node(self, target: str) -> FleetNode:
        return self.node(target.rsplit("-", 1)[0])

    def targets(self) -> list[str]:
        return [t for node in self.nodes for t in node.target_names()]

    @property
    def gateway(self) -> str:
        """The operator's own address on the bridge (nodes reach this machine there)."""
        return f"{self.subnet}.1"

    def write_inventory(self, path: Path, addresses: dict[str, tuple[str, int]] | None = None) -> Path:
        """An inventory of every node and target; `addresses` reroutes nodes (name -> (host, port))."""
        nodes = {}
        for node in self.nodes:
            entry = {**node.sshd.node_entry(), **self.node_settings}
            if addresses and node.name in addresses:
                entry["address"], entry["port"] = addresses[node.name]
            nodes[node.name] = entry
        targets = {f"{node.name}-{ctid}": node.sshd.target_entry(ctid) for node in self.nodes for ctid in node.ctids}
        path.write_text(yamlsafe.dump({"nodes": nodes, "targets": targets}))
        return path

    def with_latency(self, rtt: float) -> Path:
        """An inventory whose nodes are reached through a relay adding `rtt` seconds per round trip."""
        addresses = {}
        for node in self.nodes:
            relay = subprocess.Popen([sys.executable, "-m", "dflash_ops.testing.relay", "--to", f"{node.address}:22",
                                      "--rtt", str(rtt)], stdout=subprocess.PIPE, text=True,
                                     cwd=str(Path(__file__).resolve().parents[2]))
            self.processes.append(relay)
            assert relay.stdout is not None
            line = relay.stdout.readline()
            if not line.startswith("port "):
                raise RuntimeError(f"relay for {node.name} did not start: {line!r}")
            port = int(line.split()[1])
            with open(node.sshd.known_hosts, "a") as f:
                f.write(node.sshd.host_key_line("127.0.0.1", port))
            addresses[node.name] = ("127.0.0.1", port)
        name = f"inventory-rtt{int(rtt * 1000)}ms-{len(self.processes)}.yaml"
        return self.write_inventory(self.workdir / name, addresses)

    def _pin_neighbours(self, node: FleetNode) -> None:
        """Permanent neighbour entries inside `node` for the bridge and every other node."""
        peers = [(self.gateway, self.bridge_mac)] + [(n.address, n.mac) for n in self.nodes if n is not node]
        batch = "".join(f"neigh replace {address} lladdr {mac} dev eth0 nud permanent\n" for address, mac in peers)
        done = subprocess.run(["ip", "-n", node.netns, "-batch", "-"], input=batch, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ip -n {node.netns} -batch: {done.stderr.strip()}")

    def close(self) -> None:
        """Remove everything the fleet made, even after a failed start; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for node in self.nodes:
            node._cancel_timer()
        for proc in self.processes:
            if proc.poll() is None:
                proc.kill()
        for node in self.nodes:
            if node.sshd is not None:
                node.sshd.close()
        for netns in _fleet_namespaces(self.tag):
            _kill_namespace_processes(netns)
            _ip("netns", "del", netns, check=False)
        for proc in self.processes:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for node in self.nodes:
            for mount in node.disk_mounts:
                subprocess.run(["umount", "-l", str(mount)], capture_output=True)
        _ip("link", "del", self.bridge, check=False)


def _fleet_namespaces(tag: str) -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(f"{NETNS_PREFIX}{tag}-")]


def _kill_namespace_processes(netns: str) -> None:
    """SIGKILL every process in one of our namespaces (all of them were started by the fleet)."""
    for _ in range(3):
        pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
        if not pids:
            return
        kill_all(pids)
        threading.Event().wait(0.1)


def _stale(name: str, prefix: str) -> bool:
    """Is `name` one of ours (PREFIX<pid>x<k>...) whose creating process is gone?"""
    pid, x, _k = name[len(prefix):].split("-", 1)[0].partition("x")
    return name.startswith(prefix) and x == "x" and pid.isdigit() and not os.path.exists(f"/proc/{pid}")


def sweep_stale() -> list[str]:
    """Remove fleets whose creating process is gone (a killed test session): our names only."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if _stale(name, NETNS_PREFIX):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for link in json.loads(_ip("-j", "link", "show", "type", "bridge", check=False).stdout or "[]"):
        name = link.get("ifname", "")
        if _stale(name, LINK_PREFIX):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _free_subnet(seed: int) -> str:
    used = _ip("-4", "-o", "addr", "show", check=False).stdout + _ip("-4", "route", "show", "table", "all",
                                                                       check=False).stdout
    for k in range(4096):
        n = (seed + k * 7919) % (50 * 256)
        subnet = f"10.{200 + n // 256}.{n % 256}"
        if f" {subnet}." not in used and f"\n{subnet}." not in used and not used.startswith(f"{subnet}."):
            return subnet
    raise RuntimeError("no free 10.200-249.x.0/24 subnet for the fleet")


def start_fleet(
    workdir: Path,
    nodes: int = 4,
    ctids: tuple[int, ...] = (200,),
    *,
    disk_mb: int | None = None,
    connect_timeout: float = 3.0,
    keepalive: int = 1,
) -> Fleet:
    """Start `nodes` nodes n0..n{N-1}, each holding containers `ctids` (targets n<i>-<ctid>).

    `connect_timeout` and `keepalive` go into the inventory's nodes (small, so that faults show
    quickly in tests). Raises RuntimeError with the reason when the machine cannot host it.
    """
    reason = netns_unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    if not 1 <= nodes <= 200:
        raise ValueError("nodes: 1..200")
    sweep_stale()
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}x{next(_counter)}"
    fleet = Fleet(workdir=workdir, tag=tag, bridge=f"{LINK_PREFIX}{tag}", subnet=_free_subnet(os.getpid() * 16 + int(tag.split("x")[1])),
                  node_settings={"connect_timeout": connect_timeout, "keepalive": keepalive})
    atexit.register(fleet.close)
    try:
        _ip("link", "add", fleet.bridge, "type", "bridge")
        _ip("addr", "add", f"{fleet.gateway}/24", "dev", fleet.bridge)
        _ip("link", "set", fleet.bridge, "up")
        for i in range(nodes):
            _start_node(fleet, i, ctids, disk_mb)
        # a bridge takes the lowest MAC of its ports: read it once they are all attached
        fleet.bridge_mac = json.loads(_ip("-j", "link", "show", fleet.bridge).stdout)[0]["address"]
        for node in fleet.nodes:
            fleet._pin_neighbours(node)
            _ip("neigh", "replace", node.address, "lladdr", node.mac, "dev", fleet.bridge, "nud", "permanent")
        fleet.inventory = fleet.write_inventory(workdir / "inventory.yaml")
    except BaseException:
        fleet.close()
        raise
    return fleet


def _start_node(fleet: Fleet, i: int, ctids: tuple[int, ...], disk_mb: int | None) -> FleetNode:
    name = f"n{i}"
    netns = f"{NETNS_PREFIX}{fleet.tag}-{name}"
    veth = f"dfv{fleet.tag}n{i}"
    address = f"{fleet.subnet}.{10 + i}"
    a, b = (int(x) for x in fleet.subnet.split(".")[1:])
    mac = f"02:df:{a:02x}:{b:02x}:{i // 256:02x}:{i % 256:02x}"
    _ip("netns", "add", netns)
    _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
    _ip("link", "set", veth, "master", fleet.bridge, "up")
    _ip("link", "set", "eth0", "address", mac, netns=netns)
    _ip("addr", "add", f"{address}/24", "dev", "eth0", netns=netns)
    _ip("link", "set", "lo", "up", netns=netns)
    _ip("link", "set", "eth0", "up", netns=netns)
    workdir = fleet.workdir / name
    workdir.mkdir(parents=True, exist_ok=True)
    mounts = []
    if disk_mb is not None:
        for ctid in ctids:
            mount = workdir / f"ct{ctid}"
            mount.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={disk_mb}m,mode=0755", "tmpfs", str(mount)],
                           check=True, capture_output=True)
            mounts.append(mount)
    node = FleetNode(name=name, netns=netns, address=address, mac=mac, veth=veth, sshd=None,  # type: ignore[arg-type]
                     ctids=tuple(ctids), fleet=fleet, disk_mounts=mounts)
    fleet.nodes.append(node)  # before sshd starts: close() must find its mounts either way
    node.sshd = start_sshd(workdir, ctids, address=address, port=22, netns=netns, node_name=name)
    return node
