"""Measure what a container offers a training run; print the facts as JSON (python3.8+, stdlib only).

One call per `dflash-ops doctor` pass (see docs/doctor.md); the operator's side judges the
facts, so thresholds change without a new helper. Usage:

  doctor.py facts --base BASE --python PY [--gpus 0,1] [--torch none|find|full] [--nccl]
                  [--shm DIR] [--model-config FILE] [--runs-helper FILE] [--probe-timeout S]

Output, one JSON object per line: first {"clock": T} as early as possible (the operator's
side times its arrival to measure the clock offset), then the facts document. Exit status 0
whenever facts were gathered: a missing GPU or torch is a fact, not an error.

The torch facts come from a separate short process of the release's venv python (else PY)
running this same file as `doctor.py torch-probe ...`, under a timeout, with
CUDA_VISIBLE_DEVICES set to the run's GPUs as the runs helper sets it for the trainer.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import types

if not __package__:  # run as a script: its directory becomes its package (as_package.py)
    import as_package

    as_package.enter(globals())
from . import nodefacts, venvs

VERSION = 1
_SMI_QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total,memory.used,driver_version",
              "--format=csv,noheader,nounits"]


emit = nodefacts.print_json


# ---------------------------------------------------------------- filesystem and limits

def statvfs(path: str) -> dict:
    """Size and free bytes of the filesystem holding `path` (its nearest existing ancestor)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and probe != "/":
        probe = os.path.dirname(probe)
    try:
        st = os.statvfs(probe)
    except OSError as e:
        return {"path": path, "error": e.strerror or str(e)}
    return {"path": path, "measured_at": probe, "total": st.f_blocks * st.f_frsize,
            "free": st.f_bavail * st.f_frsize}


def shm_facts(path: str) -> dict:
    """/dev/shm as NCCL will meet it: whether it exists, and whether a tmpfs is mounted right there
    (statvfs of a missing /dev/shm would measure /dev, a plain directory the disk under it)."""
    exists = os.path.isdir(path)
    doc = statvfs(path) if exists else {"path": path}
    mount = mount_of(path) if exists else None
    doc.update(exists=exists, mount=mount,
               mounted_here=mount is not None and mount["point"] == os.path.realpath(path))
    return doc


def disk_facts(base: str) -> dict:
    """statvfs of base_dir, and whether it can be written: a file created and removed in it (or,
    before the first deploy, in its nearest existing ancestor, where deploy will create it)."""
    doc = statvfs(base)
    probe = os.path.abspath(base)
    while not os.path.exists(probe) and probe != "/":
        probe = os.path.dirname(probe)
    try:
        doc["readonly"] = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError:
        pass
    try:
        if probe == os.path.abspath(base):
            fd, tmp = tempfile.mkstemp(prefix=".dflash-doctor-", dir=probe)
            os.close(fd)
            os.unlink(tmp)
        elif not os.access(probe, os.W_OK | os.X_OK):
            raise OSError(13, os.strerror(13), probe)
        doc["writable"] = True
    except OSError as e:
        doc.update(writable=False, write_error=e.strerror or str(e), probed=probe)
    return doc


def read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def mount_of(path: str) -> dict | None:
    """The /proc/self/mounts line whose mount point is the longest prefix of `path`."""
    mounts = read_text("/proc/self/mounts")
    if mounts is None:
        return None
    best = None
    real = os.path.realpath(path)
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        if real == point or real.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) >= len(best["point"]):
                best = {"point": point, "fstype": fields[2], "options": fields[3]}
    return best


def meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in (read_text("/proc/meminfo") or "").splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable", "SwapTotal"):
                out[key] = int(rest.split()[0]) * 1024
    except ValueError:
        pass
    return out


def cgroup_memory() -> dict:
    """The container's own memory cgroup (what /proc/meminfo does not show without lxcfs): its
    limit (None: none), usage and OOM kills so far, from cgroup v2 (a Proxmox 7+ CT) or v1."""
    v2 = read_text("/sys/fs/cgroup/memory.max")
    if v2 is not None:
        out = {"version": 2, "limit": None if v2.strip() == "max" else _int(v2),
               "usage": _int(read_text("/sys/fs/cgroup/memory.current"))}
        events = read_text("/sys/fs/cgroup/memory.events") or ""
    else:
        text = read_text("/sys/fs/cgroup/memory/memory.limit_in_bytes")
        if text is None:
            return {"version": None, "limit": None, "usage": None, "oom_kills": None}
        value = _int(text)
        out = {"version": 1, "limit": None if value is None or value >= 1 << 60 else value,
               "usage": _int(read_text("/sys/fs/cgroup/memory/memory.usage_in_bytes"))}
        events = read_text("/sys/fs/cgroup/memory/memory.oom_control") or ""
    kills = [line.split()[1] for line in events.splitlines() if line.startswith("oom_kill ")]
    out["oom_kills"] = _int(kills[0]) if kills else None
    return out


def _int(text: str | None) -> int | None:
    try:
        return int((text or "").strip())
    except ValueError:
        return None


def pid_namespace() -> dict:
    """Whose processes the container sees: its PID namespace and what runs as pid 1 there."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = None
    return {"ns": ns, "pid1": (read_text("/proc/1/comm") or "").strip() or None}


def venv_support(python: str) -> dict:
    """Can `python` make a venv with pip (Debian: only with python3-venv, which ships ensurepip)?"""
    import subprocess

    code = "import importlib.util as u; print(int(bool(u.find_spec('venv'))), int(bool(u.find_spec('ensurepip'))), int(bool(u.find_spec('pip'))))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    if len(out) != 3:
        return {"venv": None, "ensurepip": None, "pip": None}
    return {"venv": out[0] == "1", "ensurepip": out[1] == "1", "pip": out[2] == "1"}


def limit(which: int) -> dict[str, int | None]:
    soft, hard = resource.getrlimit(which)
    unlimited = resource.RLIM_INFINITY
    return {"soft": None if soft == unlimited else soft, "hard": None if hard == unlimited else hard}


# ---------------------------------------------------------------- GPUs seen from the container

def device_nodes() -> dict[str, str]:
    """/dev/nvidia* character devices: name -> "major:minor"."""
    nodes: dict[str, str] = {}
    try:
        names = sorted(os.listdir("/dev"))
    except OSError:
        return nodes
    for name in names:
        if not name.startswith("nvidia"):
            continue
        try:
            st = os.stat(os.path.join("/dev", name))
        except OSError:
            continue
        nodes[name] = "%d:%d" % (os.major(st.st_rdev), os.minor(st.st_rdev))
    return nodes


def char_majors() -> dict[str, int]:
    """Character-device majors of the nvidia drivers from /proc/devices (the node's kernel)."""
    majors: dict[str, int] = {}
    character_devices = (read_text("/proc/devices") or "").split("Block devices:")[0]
    for line in character_devices.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0].isdigit() and fields[1].startswith("nvidia"):
            majors[fields[1]] = int(fields[0])
    return majors


def proc_driver_version() -> str | None:
    first = (read_text("/proc/driver/nvidia/version") or "").split("\n")[0]
    for word in first.split():
        parts = word.split(".")
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            return word
    return None


# Where the NVIDIA user-space libraries are (dflash_ops/provision/userspace.py LIB_DIRS: keep the two equal).
USERSPACE_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib", "lib/x86_64-linux-gnu",
                  "usr/lib/x86_64-linux-gnu/nvidia/current")
USERSPACE_LIBS = ("libnvidia-ml.so", "libcuda.so")


def userspace_versions(root: str) -> dict:
    """Versions of the NVIDIA user-space libraries in the container (libnvidia-ml.so.X.Y.Z, libcuda.so.X.Y.Z)
    under `root` (its `/`; a directory container's own tree on the simulated node)."""
    found = {}  # type: dict[str, list[str]]
    for sub in USERSPACE_DIRS:
        directory = os.path.join(root, sub)
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            for lib in USERSPACE_LIBS:
                match = re.match(re.escape(lib) + r"\.(\d+\.\d+(?:\.\d+)?)$", name)
                if match:
                    found.setdefault(match.group(1), []).append(os.path.join(directory, name))
    return {"versions": sorted(found), "files": {v: sorted(f) for v, f in found.items()}}


# The driver's user-space packages (dflash_ops/doctor/node.py DRIVER_USERSPACE_PACKAGES and UBUNTU_USERSPACE:
# keep them equal): Debian's names, and Ubuntu's that carry the branch (libnvidia-compute-550, nvidia-utils-550-server).
USERSPACE_PACKAGES = ("libcuda1", "libnvidia-ml1", "nvidia-smi", "libnvidia-ptxjitcompiler1", "libnvidia-nvvm4",
                      "libcudadebugger1")
UBUNTU_USERSPACE = re.compile(r"(?:libnvidia-compute|nvidia-utils)-(\d+)(-server)?")


def userspace_packages(root: str) -> dict:
    """{package: [version, held]} of the NVIDIA user-space packages installed in the container, read from
    dpkg's status database under `root` (none: a container without dpkg, or without them)."""
    try:
        with open(os.path.join(root, "var/lib/dpkg/status"), encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return {}
    found = {}  # type: dict[str, list]
    for stanza in text.split("\n\n"):
        fields = {}
        for line in stanza.splitlines():
            key, sep, value = line.partition(": ")
            if sep and not line[:1].isspace():
                fields[key] = value.strip()
        status = fields.get("Status", "").split()
        name = fields.get("Package", "")
        userspace = name in USERSPACE_PACKAGES or UBUNTU_USERSPACE.fullmatch(name) is not None
        if userspace and len(status) == 3 and status[2] == "installed":
            found[fields["Package"]] = [fields.get("Version", ""), status[0] == "hold"]
    return found


def libcuda_version() -> dict:
    """cuDriverGetVersion() through ctypes: the newest CUDA the installed driver supports (e.g. 13000)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return {"error": str(e)}
    version = ctypes.c_int(0)
    status = lib.cuDriverGetVersion(ctypes.byref(version))
    if status != 0:
        return {"error": "cuDriverGetVersion returned %d" % status}
    return {"version": version.value}


def nvidia_smi() -> dict:
    if shutil.which("nvidia-smi") is None:
        return {"error": "nvidia-smi not found"}
    try:
        done = subprocess.run(_SMI_QUERY, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}
    if done.returncode != 0:
        return {"error": (done.stderr.strip() or done.stdout.strip() or "exit %d" % done.returncode)[:300]}
    gpus = []
    for line in done.stdout.splitlines():
        fields = [x.strip() for x in line.split(",")]
        if len(fields) != 5 or not fields[0].isdigit():
            continue
        gpus.append({"index": int(fields[0]), "name": fields[1], "mem_total_mib": _number(fields[2]),
                     "mem_used_mib": _number(fields[3]), "driver": fields[4]})
    return {"gpus": gpus}


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


# ---------------------------------------------------------------- the deployed release and its runs

def release_facts(base: str) -> dict:
    root = os.path.join(base, "current")
    if not os.path.isdir(root):
        return {"deployed": False, "root": root}
    doc = nodefacts.read_json(os.path.join(root, ".dflash-release.json")) or {}
    facts = {"deployed": True, "root": root, "hash": doc.get("hash"), "venv": doc.get("venv")}
    python = venvs.release_python(base, doc)
    if python is not None:
        facts["venv_python"] = python
        facts["venv_python_exists"] = os.path.exists(python)
    return facts


def held_gpus(runs_helper: str | None, base: str, python: str) -> dict:
    """Live runs and their GPUs, from the runs helper's `list` (same directory rules as `run start`)."""
    if not runs_helper:
        return {"error": "no runs helper given"}
    if not os.path.isfile(runs_helper):
        return {"missing": runs_helper}
    try:
        done = subprocess.run([python, runs_helper, "list", base], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, universal_newlines=True, timeout=60)
        doc = json.loads(done.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)[:300]}
    live = []
    for run in doc.get("runs", []):
        if run.get("alive") and run.get("effective_state") not in nodefacts.FINAL_STATES:
            live.append({"run_id": run.get("run_id"), "pid": run.get("pid"), "gpus": run.get("gpus") or []})
    return {"live": live}


def model_dims(path: str | None) -> dict | None:
    if not path:
        return None
    doc = nodefacts.read_json(path)
    if doc is None:
        return {"error": "cannot read %s" % path}
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "num_hidden_layers")
    text = doc.get("text_config")
    text = text if isinstance(text, dict) else doc  # Qwen3.5: its text part
    dims = {k: text.get(k) for k in keys}
    dims["config"] = doc  # the whole config.json: the operator side reads the family from it
    return dims


# ---------------------------------------------------------------- torch, in a short child process

def run_probe(python: str, gpus: list[int], mode: str, nccl: bool, timeout: float) -> dict | None:
    if mode == "none":
        return None
    env = dict(os.environ)
    if gpus:  # as the runs helper's child_env: no GPU list, no restriction
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    argv = [python, os.path.abspath(__file__), "torch-probe", "--mode", mode]
    if nccl:
        argv.append("--nccl")
    began = time.time()
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                              universal_newlines=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"python": python, "error": "timed out after %gs" % timeout, "timed_out": True}
    except OSError as e:
        return {"python": python, "error": "cannot run %s: %s" % (python, e.strerror or e)}
    seconds = round(time.time() - began, 2)
    for line in reversed(done.stdout.splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        doc.update(python=python, seconds=seconds, visible=env.get("CUDA_VISIBLE_DEVICES"))
        return doc
    tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-3:]
    return {"python": python, "error": "exit %d: %s" % (done.returncode, " | ".join(tail))}


def torch_probe(mode: str, nccl: bool) -> int:
    """Runs under the venv's python: what torch sees. Prints one JSON object."""
    out: dict = {"python_version": "%d.%d.%d" % sys.version_info[:3]}
    if mode == "find":
        import importlib.util

        out["torch_found"] = importlib.util.find_spec("torch") is not None
        emit(out)
        return 0
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a broken torch install is the answer
        out.update(torch_found=False, error="import torch: %s: %s" % (type(e).__name__, e))
        emit(out)
        return 0
    out.update(torch_found=True, torch=torch.__version__, cuda_built=torch.version.cuda)
    out["cuda_available"] = bool(torch.cuda.is_available())
    out["device_count"] = torch.cuda.device_count() if out["cuda_available"] else 0
    devices = []
    for i in range(out["device_count"]):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        devices.append({"index": i, "name": props.name, "total": total, "free": free,
                        "capability": "%d.%d" % (props.major, props.minor)})
    out["devices"] = devices
    if out["cuda_available"]:
        try:
            out["nccl_version"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception as e:  # noqa: BLE001
            out["nccl_version_error"] = str(e)
    if nccl:
        out["nccl"] = all_reduce(torch, out["device_count"])
    emit(out)
    return 0


def all_reduce(torch: types.ModuleType, count: int) -> dict:
    """torch.cuda.nccl.all_reduce across every visible GPU, in-process, as trainer/pipeline/grad_sync does."""
    if count < 1:
        return {"ok": False, "error": "no CUDA device visible"}
    began = time.time()
    try:
        tensors = [torch.full((1 << 20,), float(i + 1), device="cuda:%d" % i) for i in range(count)]
        torch.cuda.nccl.all_reduce(tensors)
        for i in range(count):
            torch.cuda.synchronize(i)
        want = count * (count + 1) / 2
        wrong = [i for i, t in enumerate(tensors) if not bool((t == want).all())]
    except Exception as e:  # noqa: BLE001 - NCCL's own error text is the answer
        return {"ok": False, "error": "%s: %s" % (type(e).__name__, str(e)[:400]),
                "seconds": round(time.time() - began, 3)}
    if wrong:
        return {"ok": False, "error": "wrong sum on GPU %s" % wrong, "seconds": round(time.time() - began, 3)}
    return {"ok": True, "gpus": count, "mib": 4, "seconds": round(time.time() - began, 3)}


# ---------------------------------------------------------------- a non-root user's device access

def device_access(user: "str | None", root: str = "/") -> "dict | None":
    """Whether `user` (the inventory's `user:` of the target) can open each NVIDIA device node for
    reading and writing, as CUDA does: a child takes the user's uid, gid and groups and opens each
    one. {"user", "paths": {path: "ok" | error}} or {"user", "error"}; None when no user is asked."""
    if not user:
        return None
    import pwd

    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return {"user": user, "error": "no such user in the container"}
    dev = os.path.join(root, "dev")
    try:
        paths = sorted(os.path.join(dev, n) for n in os.listdir(dev) if n.startswith("nvidia"))
    except OSError:
        paths = []
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drops to the user, opens, reports on the pipe, exits
        try:
            os.close(read_fd)
            os.initgroups(user, entry.pw_gid)
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            found = {}
            for path in paths:
                try:
                    os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY))
                    found[path] = "ok"
                except OSError as e:
                    found[path] = e.strerror or str(e)
            os.write(write_fd, json.dumps(found).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks = []
    while True:
        chunk = os.read(read_fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_fd)
    os.waitpid(pid, 0)
    try:
        return {"user": user, "paths": json.loads(b"".join(chunks).decode() or "{}")}
    except ValueError:
        return {"user": user, "error": "could not become the user (uid %d)" % entry.pw_uid}


# ---------------------------------------------------------------- the facts document

def facts(args: argparse.Namespace) -> int:
    emit({"clock": time.time()})
    gpus = nodefacts.parse_gpus(args.gpus)
    release = release_facts(args.base)
    probe_python = release["venv_python"] if release.get("venv_python_exists") else args.python
    doc = {
        "version": VERSION,
        "python": {"executable": sys.executable, "version": "%d.%d.%d" % sys.version_info[:3]},
        "release": release,
        "disk": disk_facts(args.base),
        "shm": shm_facts(args.shm),
        "memory": meminfo(),
        "cgroup_memory": cgroup_memory(),
        "pid_namespace": pid_namespace(),
        "venv_support": venv_support(args.python),
        "limits": {"memlock": limit(resource.RLIMIT_MEMLOCK), "nofile": limit(resource.RLIMIT_NOFILE)},
        "devices": device_nodes(),
        "majors": char_majors(),
        "driver": {"proc": proc_driver_version(), "libcuda": libcuda_version()},
        "userspace": dict(userspace_versions(args.root), packages=userspace_packages(args.root)),
        "smi": nvidia_smi(),
        "runs": held_gpus(args.runs_helper, args.base, sys.executable),
        "model": model_dims(args.model_config),
        "torch": run_probe(probe_python, gpus, args.torch, args.nccl, args.probe_timeout),
        "gpus": gpus,
        "device_access": device_access(args.device_user, args.root),
    }
    emit(doc)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="doctor.py")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("facts")
    s.add_argument("--base", required=True)
    s.add_argument("--python", required=True)
    s.add_argument("--gpus", default="")
    s.add_argument("--torch", choices=("none", "find", "full"), default="full")
    s.add_argument("--nccl", action="store_true")
    s.add_argument("--shm", default="/dev/shm")
    s.add_argument("--model-config")
    s.add_argument("--runs-helper")
    s.add_argument("--probe-timeout", type=float, default=120.0)
    s.add_argument("--root", default="/")
    s.add_argument("--device-user")
    s.set_defaults(func=facts)
    s = sub.add_parser("torch-probe")
    s.add_argument("--mode", choices=("find", "full"), default="full")
    s.add_argument("--nccl", action="store_true")
    s.set_defaults(func=lambda a: torch_probe(a.mode, a.nccl))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
