"""Judge the facts of one doctor pass: one Check per question, with the fix in one line.

Every threshold and its reason is in docs/doctor.md; keep the two in step.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash_ops import render
from dflash_ops.doctor.node import NVIDIA_MAJOR, UNIT, DriverPackages, NodeFacts
from dflash_ops.doctor.plan import GIB, MIB, RunPlan
from dflash_ops.helpers import venvs

OK, WARN, FAIL = "ok", "warn", "fail"
SYMBOLS = {OK: "✔", WARN: "!", FAIL: "✘"}
PYTHON_MIN = (3, 8)  # the helpers' floor
PYTHON_NEEDED = ">= " + ".".join(map(str, PYTHON_MIN))
# Minimum driver branch per CUDA major under minor-version compatibility
# (docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html).
DRIVER_FOR_CUDA = {11: 450, 12: 525, 13: 580}
NOFILE_MIN = 4096
CLOCK_TOLERANCE_S = 1.0
GPU_BUSY_SHARE = 0.10  # memory used by someone else, as a share of a GPU, before it is flagged


@dataclass
class Check:
    name: str
    status: str
    measured: str
    needed: str
    fix: str = ""

    @property
    def symbol(self) -> str:
        return SYMBOLS[self.status]


@dataclass
class Inputs:
    """Everything one pass measured; facts is the doctor helper's document (None if it never ran)."""

    target: Any
    plan: RunPlan
    node: NodeFacts
    facts: dict | None = None
    helper_error: str | None = None
    clock: tuple[float, float] | None = None  # (offset s, +- s): container minus operator
    fast: bool = False

    @property
    def found(self) -> dict:
        """The facts, for the judges that evaluate() calls only once the helper answered."""
        assert self.facts is not None
        return self.facts


def gib(n: float | None) -> str:
    if n is None:
        return "?"
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def evaluate(i: Inputs) -> list[Check]:
    checks = [container_check(i)]
    if i.node.pct and i.node.state in ("running", "stopped"):
        checks.append(passthrough_check(i))
        unit = boot_unit_check(i)
        if unit is not None:
            checks.append(unit)
    if i.node.state != "running":
        return checks
    if i.facts is None:
        checks.append(Check("python", FAIL, i.helper_error or "the doctor helper did not run", PYTHON_NEEDED,
                            f"install python3 in the container, or set `python:` for {i.target.name} in the inventory"))
        return checks
    for judge in (config_check, target_model_check, memory_plan_check, python_check, venv_support_check, pid_namespace_check, release_check, torch_check, gpus_container_check, gpus_torch_check, held_check,
                  device_access_check, driver_check, userspace_check, nccl_check, shm_check, disk_check, ram_check, memlock_check, nofile_check,
                  clock_check):
        check = judge(i)
        if check is not None:
            checks.append(check)
    return checks


def verdict(checks: list[Check]) -> str:
    statuses = {c.status for c in checks}
    return FAIL if FAIL in statuses else WARN if WARN in statuses else OK


def judged(name: str, good: bool, measured: str, needed: str, fix: str, bad: str = FAIL) -> Check:
    """The common shape of a check: OK when `good`, else `bad` with the fix."""
    return Check(name, OK, measured, needed) if good else Check(name, bad, measured, needed, fix)


# ---------------------------------------------------------------- node side

def container_check(i: Inputs) -> Check:
    t, node = i.target, i.node
    if not node.pct:
        return judged("container", node.state == "running", node.detail or node.state, "reachable",
                      f"check that node {t.node.name} answers")
    fixes = {
        "stopped": f"on node {t.node.name}: pct start {t.ctid}",
        "missing": f"container {t.ctid} does not exist on node {t.node.name}: fix ctid in the inventory or create it",
        "unreachable": f"check that node {t.node.name} answers (ssh, address, keys)",
    }
    measured = node.state + (f" ({node.detail})" if node.detail else "")
    return judged("container", node.state == "running", measured, "running",
                  fixes.get(node.state, f"look at `pct status {t.ctid}` on node {t.node.name}"))


def _gpu_paths(i: Inputs) -> list[str]:
    indices = i.plan.gpus or tuple(range(i.plan.gpu_count))
    return [f"/dev/nvidia{g}" for g in indices] + ["/dev/nvidiactl", "/dev/nvidia-uvm"]


def passthrough_check(i: Inputs) -> Check:
    """The container config binds the run's GPUs and allows them in the device cgroup."""
    t, config = i.target, i.node.config
    if config is None:
        return Check("gpu passthrough", WARN, f"pct config failed: {i.node.config_error}", "readable config",
                     f"run `pct config {t.ctid}` on node {t.node.name}")
    passthrough, mounted = config.passthrough_paths(), config.bind_mounted()
    present = sorted(p for p in passthrough | mounted if p.startswith("/dev/nvidia"))
    measured = ", ".join(p.removeprefix("/dev/") for p in present) or "no /dev/nvidia* entries"
    if not i.plan.needs_gpu:
        return Check("gpu passthrough", OK, measured, i.plan.no_gpu)
    uvm = ((i.facts or {}).get("majors") or {}).get("nvidia-uvm")
    paths = _gpu_paths(i)
    missing_paths = [p for p in paths if p not in passthrough and p not in mounted]
    missing_allow = []
    if any(p in mounted and p not in passthrough for p in paths if p != "/dev/nvidia-uvm") \
            and not config.allows(NVIDIA_MAJOR):
        missing_allow.append(f"c {NVIDIA_MAJOR}:* rwm")
    if "/dev/nvidia-uvm" in mounted and "/dev/nvidia-uvm" not in passthrough and not (uvm and config.allows(uvm)):
        missing_allow.append(f"c {uvm if uvm else '<nvidia-uvm major from /proc/devices>'}:* rwm")
    needed = ", ".join(p.removeprefix("/dev/") for p in paths)
    if not missing_paths and not missing_allow:
        return Check("gpu passthrough", OK, measured, needed)
    allow_lines = [f"lxc.cgroup2.devices.allow: {a}" for a in missing_allow]
    if not missing_paths:
        fix = f"add to /etc/pve/lxc/{t.ctid}.conf on {t.node.name}: " + " | ".join(allow_lines)
    elif mounted & set(paths):  # the config already binds GPUs by mount entries: keep its style
        lines = [f"lxc.mount.entry: {p} {p[1:]} none bind,optional,create=file" for p in missing_paths]
        fix = f"add to /etc/pve/lxc/{t.ctid}.conf on {t.node.name}, then restart the CT: " + " | ".join(
            lines + allow_lines)
    else:
        free = (n for n in itertools.count() if n not in config.used_dev_indices())
        args = " ".join(f"--dev{next(free)} {p}" for p in missing_paths)
        fix = f"on node {t.node.name}: pct set {t.ctid} {args} (then restart the CT)"
    gaps = [p.removeprefix("/dev/") for p in missing_paths] + [f"cgroup allow {a}" for a in missing_allow]
    return Check("gpu passthrough", FAIL, f"{measured}; missing {', '.join(gaps)}", needed, fix)


def boot_unit_check(i: Inputs) -> Check | None:
    """A container with devN GPU entries starts only where the device nodes exist (pct start checks
    each path): after a node reboot they may not, unless a boot unit makes them (provision/bootunit.py)."""
    config, state, t = i.node.config, i.node.boot_unit, i.target
    if config is None or state is None or not any(p.startswith("/dev/nvidia") for p in config.passthrough_paths()):
        return None
    needed = "enabled: the device nodes exist at boot, before pve-guests"
    if state == "enabled":
        return Check("boot unit", OK, f"{UNIT}: enabled", needed)
    return Check("boot unit", WARN, f"{UNIT} on node {t.node.name}: {state}", needed,
                 f"dflash-ops provision {t.name} --boot-unit --yes (or doctor --fix): else after a node reboot "
                 "`pct start` may fail with `Device /dev/nvidia-uvm does not exist`")


# ---------------------------------------------------------------- inside the container

def config_check(i: Inputs) -> Check | None:
    if i.plan.config_error:
        return Check("trainer config", WARN, i.plan.config_error, "a config of the bundled trainer",
                     "GPU, disk and RAM needs are not sized from it; fix it if the release runs the bundled trainer")
    if i.plan.config_path is None:
        return None
    devices = ", ".join(f"cuda:{c}" for c in i.plan.cuda_indices) or "cpu"
    return Check("trainer config", OK, f"{i.plan.config_path}: devices {devices}", "a valid config")


def target_model_check(i: Inputs) -> Check | None:
    """The target's family from its config.json in the container (trainer.run.family): layers by
    kind, MoE, the weights' memory in the run's dtype; a quantized checkpoint the trainer cannot read,
    and packed rows where the family cannot have them exactly, fail here (the trainer refuses both at
    config load)."""
    from trainer.run.family import read_family

    model = i.found.get("model")
    if not model or "error" in model or not isinstance(model.get("config"), dict):
        return None
    try:
        fam = read_family(model["config"])
    except (KeyError, TypeError) as exc:
        return Check("target model", WARN, f"config.json unreadable as a causal LM ({exc})", "a model config")
    weights = fam.bytes(i.plan.dtype_bytes)
    gpu = max((d.get("total") or 0 for d in (i.found.get("torch") or {}).get("devices") or []), default=0)
    measured = f"{fam.summary()}; layers: {fam.layer_table()}"
    needed = f"{gib(weights)} of weights" + (f" ({gib(gpu)} per GPU: split it, devices.target [[...]])"
                                             if gpu and weights > gpu else "")
    if fam.quantization_refusal:
        return Check("target model", FAIL, measured, "weights the trainer reads", fam.quantization_refusal)
    if i.plan.pack_length and fam.pack_refusal:
        return Check("target model", FAIL, measured, "packed rows exact for this family",
                     f"set data.pack_length: 0 ({fam.pack_refusal})")
    return Check("target model", OK, measured, needed)


def memory_plan_check(i: Inputs) -> Check | None:
    """The trainer's memory plan (trainer.models.memory_plan: bytes per target stage, drafter replica
    and device) against each GPU's memory as torch measured it in the container. Needs the config,
    the model's config.json (read on the node) for a model directory, and torch + transformers on
    this side (they come with the `dflash-ops` install today); without them the check is skipped."""
    if i.plan.config_path is None or i.plan.config_error or not i.plan.needs_gpu:
        return None
    devices = _torch(i).get("devices") or []
    model = _model_dims(i) or {}
    if not devices:
        return None
    try:
        from trainer.models.memory_plan import build_plan
        from trainer.run.config import ConfigError, load_config
    except ImportError:
        return None
    try:
        cfg = load_config(i.plan.config_path)
    except ConfigError:
        return None
    if cfg.model.target.path is not None and not model.get("config"):
        return None
    needed = "each device's share within its memory"
    try:
        from trainer.models.target_loading import SplitError
    except ImportError:
        return None
    try:
        plan = build_plan(cfg, model.get("config"), {d["index"]: d["total"] for d in devices})
    except SplitError as e:  # the loader's own refusal: training would stop on it
        return Check("GPU memory plan", FAIL, str(e), needed, "python -m trainer plan --config C says more")
    except (ValueError, KeyError, OSError) as e:
        return Check("GPU memory plan", WARN, f"not sized: {e}", needed, "python -m trainer plan --config C says more")
    measured = "; ".join(f"{d.device} {gib(d.total)}" + (f" of {gib(d.budget)}" if d.budget else "")
                         for d in plan.devices)
    refusal = plan.refusal()
    if refusal is None:
        return Check("GPU memory plan", OK, measured, needed)
    if plan.missing is not None:
        fix = "name only the container's GPUs in devices:" + (f" e.g. {plan.suggestion}" if plan.suggestion else "")
    else:
        fix = (f"split the target: devices: {plan.suggestion}" if plan.suggestion
               else "split the target over more GPUs (devices.target: [[cuda:0, cuda:1, ...]]) or shorten the micro-batch")
    return Check("GPU memory plan", FAIL, refusal, needed, fix)


def python_check(i: Inputs) -> Check:
    py = i.found["python"]
    version = tuple(int(x) for x in py["version"].split(".")[:2])
    return judged("python", version >= PYTHON_MIN, f"{py['version']} ({py['executable']})", PYTHON_NEEDED,
                  "install a newer python3 in the container, or point `python:` at one")


def venv_support_check(i: Inputs) -> Check | None:
    """deploy makes a venv without pip, then needs ensurepip (or pip) only when the container's
    packages do not already satisfy the requirements. Debian's python3 has ensurepip only with
    python3-venv, which a fresh Proxmox CT lacks."""
    support = i.found.get("venv_support")
    if not support or support.get("venv") is None:
        return None
    install = venvs.NO_PIP_FIX_ARGV
    fix = f"in the container: {render.node_command(install)} (on node {i.target.node.name}: " \
          f"{render.node_command(['pct', 'exec', str(i.target.ctid), '--', *install])})" if i.node.pct else \
          render.node_command(install)
    if not support["venv"]:
        return Check("python venv", FAIL, "no venv module", "venv, and ensurepip or pip", fix)
    if support["ensurepip"] or support["pip"]:
        return Check("python venv", OK, "venv, " + ("ensurepip" if support["ensurepip"] else "pip (no ensurepip)"),
                     "venv, and ensurepip or pip")
    return Check("python venv", WARN, "venv without ensurepip or pip: deploy works only while the container's "
                 "packages satisfy every requirement", "venv, and ensurepip or pip", fix)


def pid_namespace_check(i: Inputs) -> Check | None:
    """What the container sees as pid 1, in which PID namespace (a directory container sees the machine's)."""
    ns = i.found.get("pid_namespace")
    if not ns or not ns.get("ns"):
        return None
    return Check("PID namespace", OK, f"{ns['ns']}, pid 1: {ns.get('pid1') or '?'}", "the container's own")


def _cgroup_memory(i: Inputs) -> dict:
    return i.found.get("cgroup_memory") or {}


def release_check(i: Inputs) -> Check:
    rel, name = i.found["release"], i.target.name
    if not rel.get("deployed"):
        return Check("release + venv", WARN, "nothing deployed", "a deployed release",
                     f"dflash-ops deploy {name}")
    label = f"release {str(rel.get('hash') or '?')[:12]}"
    if rel.get("venv_python"):
        if not rel.get("venv_python_exists"):
            return Check("release + venv", FAIL, f"{label}: {rel['venv_python']} missing", "the release's venv",
                         f"dflash-ops deploy {name} (rebuilds the venv)")
        return Check("release + venv", OK, f"{label}, venv {rel['venv']}", "the release's venv")
    return Check("release + venv", OK, f"{label}, no venv (the target's python)", "a deployed release")


def _torch(i: Inputs) -> dict:
    return i.found.get("torch") or {}


def torch_check(i: Inputs) -> Check:
    t, name = _torch(i), i.target.name
    where = t.get("python", "?")
    if not t.get("torch_found"):
        error = t.get("error") or "no torch"
        if t.get("timed_out") or "cannot run" in error:
            fix = f"look at `dflash-ops exec {name} -- {where} -c 'import torch'`"
        else:
            fix = ("add torch to trainer/requirements.txt, or install it in the container and keep "
                   f"venv.system_site_packages: true; then dflash-ops deploy {name}")
        return Check("torch", FAIL, f"{where}: {error}", "torch importable", fix)
    if "torch" not in t:
        return Check("torch", OK, f"found by {where} (not imported: fast check)", "torch importable")
    built = t.get("cuda_built")
    if i.plan.needs_gpu and not built:
        return Check("torch", FAIL, f"{t['torch']} is a CPU build ({where})", "a CUDA build of torch",
                     f"install a CUDA build of torch (e.g. the cu130 wheels) in the venv, then dflash-ops deploy {name}")
    needed = "torch importable" + ("; a CUDA build" if i.plan.needs_gpu else "")
    return Check("torch", OK, f"{t['torch']} ({'CUDA ' + built if built else 'CPU build'}) in {where}", needed)


def _visible_indices(i: Inputs) -> list[int]:
    nodes = i.found.get("devices") or {}
    return sorted(int(n[6:]) for n in nodes if n[6:].isdigit())


def gpus_container_check(i: Inputs) -> Check:
    smi = i.found.get("smi") or {}
    nodes = _visible_indices(i)
    seen_nodes = f"/dev/nvidia{','.join(map(str, nodes))}"
    if smi.get("gpus"):
        names = sorted({g["name"] for g in smi["gpus"]})
        measured = f"{len(smi['gpus'])} × {', '.join(names)} (nvidia-smi); {seen_nodes}"
    else:
        measured = f"no GPU ({smi.get('error', 'nvidia-smi found none')}); {seen_nodes if nodes else 'no /dev/nvidiaN'}"
    if not i.plan.needs_gpu:
        return Check("GPUs in container", OK, measured, i.plan.no_gpu)
    wanted = list(i.plan.gpus or range(i.plan.gpu_count))
    seen = set(nodes) | {g["index"] for g in smi.get("gpus") or []}
    missing = [g for g in wanted if g not in seen]
    if missing:
        return Check("GPUs in container", FAIL, measured, f"/dev/nvidia{','.join(map(str, wanted))}",
                     "bind the GPUs into the container: see `gpu passthrough`" if i.node.pct else
                     "install the NVIDIA driver on this machine")
    return judged("GPUs in container", bool(smi.get("gpus")), measured, f"{len(wanted)} GPU(s)",
                  "install nvidia-smi in the container (the user-space driver of the node's version)", WARN)


def gpus_torch_check(i: Inputs) -> Check | None:
    t = _torch(i)
    if "torch" not in t and not i.plan.needs_gpu:
        return None
    if "torch" not in t:
        return Check("GPUs to torch", FAIL, t.get("error") or "torch not imported", f"{i.plan.gpu_count} GPU(s)",
                     "see `torch`")
    devices = t.get("devices") or []
    if devices:
        free = ", ".join(f"{d['index']}: {gib(d['free'])} free" for d in devices)
        names = sorted({d["name"] for d in devices})
        measured = f"{len(devices)} × {', '.join(names)}, {gib(devices[0]['total'])} each ({free})"
    else:
        measured = "torch.cuda.is_available() is False" if t.get("cuda_built") else "CPU build: no CUDA"
    if t.get("visible") is not None:
        measured += f"; CUDA_VISIBLE_DEVICES={t['visible']}"
    if not i.plan.needs_gpu:
        return Check("GPUs to torch", OK, measured, i.plan.no_gpu)
    need = i.plan.gpu_count
    if len(devices) < need:
        return Check("GPUs to torch", FAIL, measured, f"{need} GPU(s)",
                     "see `driver vs torch CUDA` and `GPUs in container`")
    if i.plan.cuda_indices and max(i.plan.cuda_indices) >= len(devices):
        return Check("GPUs to torch", FAIL, measured, f"cuda:{max(i.plan.cuda_indices)} of the config",
                     "give the run more GPUs (--gpus) or use lower cuda:N in the config's devices")
    busy = ",".join(str(d["index"]) for d in devices
                    if d["total"] and (d["total"] - d["free"]) / d["total"] > GPU_BUSY_SHARE)
    if busy:
        return Check("GPUs to torch", WARN, measured, f"{need} idle GPU(s)",
                     f"another process uses GPU {busy}: nvidia-smi on the node shows which")
    return Check("GPUs to torch", OK, measured, f"{need} GPU(s)")


def held_check(i: Inputs) -> Check:
    runs = i.found.get("runs") or {}
    if "live" not in runs:
        return Check("GPUs held by runs", WARN, f"unknown ({runs.get('error') or runs})", "no live run on them")
    live = runs["live"]
    wanted = set(i.plan.gpus)
    clash = [r["run_id"] for r in live if set(r["gpus"]) & wanted]  # the rule of `run start`
    measured = "; ".join(f"{r['run_id']} holds GPU {','.join(map(str, r['gpus'])) or 'none listed'}"
                         for r in live) or "no live runs"
    if clash:
        names = ", ".join(clash)
        # `run start` leaves the refusal to the runs helper, which checks and claims atomically
        return Check("GPUs held by runs", WARN if i.fast else FAIL, measured, f"GPU {','.join(map(str, sorted(wanted)))} free",
                     f"dflash-ops run stop {i.target.name} RUN ({names}), or start on other GPUs with --gpus")
    return Check("GPUs held by runs", OK, measured, "no live run on the run's GPUs")


def driver_check(i: Inputs) -> Check:
    drv = i.found.get("driver") or {}
    smi = (i.found.get("smi") or {}).get("gpus") or []
    version = (smi[0]["driver"] if smi else None) or drv.get("proc")
    libcuda = (drv.get("libcuda") or {}).get("version")
    built = _torch(i).get("cuda_built")
    measured = (f"driver {version}" if version else "no driver") + (
        f", supports CUDA {libcuda // 1000}.{libcuda % 1000 // 10}" if libcuda else "")
    if not i.plan.needs_gpu:
        return Check("driver vs torch CUDA", OK, measured, i.plan.no_gpu)
    if not built:
        return Check("driver vs torch CUDA", WARN if "torch" not in _torch(i) else FAIL, measured,
                     "torch built for CUDA", "see `torch`")
    major, minor = (int(x) for x in built.split(".")[:2])
    branch = DRIVER_FOR_CUDA.get(major)
    needed = f"CUDA {built} (torch): driver >= {branch}" if branch else f"a driver for CUDA {built}"
    have_branch = int(version.split(".")[0]) if version and version.split(".")[0].isdigit() else None
    ok = (libcuda is not None and libcuda >= major * 1000) and (branch is None or (have_branch or 0) >= branch)
    return judged("driver vs torch CUDA", ok, measured, needed,
                  f"install NVIDIA driver >= {branch or '?'} on node {i.target.node.name} (the container's user-space "
                  "libraries must match it), or a torch built for an older CUDA")


def userspace_check(i: Inputs) -> Check | None:
    """The container's NVIDIA user-space libraries are the node's kernel module version: else NVML
    says "Driver/library version mismatch" (after every host driver upgrade). Judged where the node
    has the module and the container is given its GPUs (or the run needs them)."""
    module = i.node.module
    config = i.node.config
    given = bool(config and any(p.startswith("/dev/nvidia") for p in config.passthrough_paths() | config.bind_mounted()))
    if not module or not (given or i.plan.needs_gpu):
        return None
    found = i.found.get("userspace") or {}
    have = found.get("versions") or []
    name = "driver user-space"
    measured = f"container {', '.join(have) or 'none'}; node kernel module {module}"
    packages = i.node.driver_packages
    if packages is not None and packages.installed:
        return _userspace_packages_check(i, packages, found.get("packages") or {}, module)
    if have == [module]:
        return Check(name, OK, measured, f"{module} (= node kernel module)")
    return Check(name, FAIL, measured, f"{module} (= node kernel module)",
                 f"dflash-ops doctor {i.target.name} --fix (installs NVIDIA-Linux-x86_64-{module}.run in the container "
                 "with --no-kernel-module)")


def _userspace_packages_check(i: Inputs, node: DriverPackages, have: dict[str, list], module: str) -> Check:
    """Where the node has its driver from packages: the container's user-space packages are the node's
    version and held (provision/driverpkgs.py), else an `apt upgrade` in the container breaks NVML."""
    name = "driver user-space"
    version = node.version
    wanted = node.for_container()
    needed = f"{', '.join(wanted)} {version} held (= node's packages, module {module})"
    problem = node.problem(i.target.node.name, module)
    measured = "container " + (", ".join(f"{p} {v[0]}{'' if v[1] else ' (not held)'}" for p, v in sorted(have.items()))
                               or "none of them")
    if problem:
        return Check(name, FAIL, measured, needed, problem)
    if all(p in have and have[p][0] == version for p in wanted):
        loose = [p for p in wanted if not have[p][1]]
        if not loose:
            return Check(name, OK, measured, needed)
        return Check(name, WARN, measured, needed, f"dflash-ops doctor {i.target.name} --fix (apt-mark hold "
                     f"{' '.join(loose)} in the container: an apt upgrade there would move them off {version})")
    return Check(name, FAIL, measured, needed,
                 f"dflash-ops doctor {i.target.name} --fix (apt-get install {' '.join(f'{p}={version}' for p in wanted)} "
                 "in the container, then apt-mark hold)")


def nccl_check(i: Inputs) -> Check | None:
    if i.fast:
        return None
    if not i.plan.needs_gpu:
        return Check("NCCL all-reduce", OK, "not run", i.plan.no_gpu)
    t = _torch(i)
    result = t.get("nccl")
    if result is None:
        return Check("NCCL all-reduce", FAIL, t.get("error") or "not run (no torch)", "an all-reduce across the GPUs",
                     "see `torch`")
    needed = "correct sum on every GPU"
    if result.get("ok"):
        return Check("NCCL all-reduce", OK, f"{result['mib']} MiB over {result['gpus']} GPU(s) in "
                     f"{result['seconds']:.2f} s (NCCL {t.get('nccl_version', '?')})", needed)
    fix = "see `/dev/shm` and `gpu passthrough`; rerun with NCCL_DEBUG=WARN in the environment for NCCL's reason" \
        if t.get("devices") else "see `GPUs to torch`"
    return Check("NCCL all-reduce", FAIL, result.get("error", "failed"), needed, fix)


def shm_check(i: Inputs) -> Check:
    shm, need = i.found["shm"], i.plan.shm_needed()
    if shm.get("exists") is False:
        return Check("/dev/shm", FAIL, f"{shm['path']} is missing", f"a tmpfs with {gib(need)} free",
                     _shm_fix(i, need, mount=True))
    mount = shm.get("mount")
    if mount and (mount.get("fstype") != "tmpfs" or shm.get("mounted_here") is False):
        return Check("/dev/shm", FAIL, f"{shm['path']} is not a tmpfs (it is {mount.get('fstype')} at {mount.get('point')})",
                     f"a tmpfs with {gib(need)} free", _shm_fix(i, need, mount=True))
    if "error" in shm:
        return Check("/dev/shm", FAIL, f"{shm['path']}: {shm['error']}", gib(need), _shm_fix(i, need))
    measured = f"{gib(shm['total'])} ({gib(shm['free'])} free) at {shm['path']}"
    why = f"{gib(need)} free ({i.plan.gpu_count} GPU run)" if i.plan.needs_gpu else f"{gib(need)} free (CPU run)"
    free = shm["free"]
    cg = _cgroup_memory(i)
    if cg.get("limit") is not None and cg.get("usage") is not None and cg["limit"] - cg["usage"] < free:
        # a tmpfs page is charged to the container's memory cgroup: the limit caps /dev/shm too
        free = max(0, cg["limit"] - cg["usage"])
        measured += f"; {gib(free)} usable under the container's memory limit of {gib(cg['limit'])}"
    return judged("/dev/shm", free >= need, measured, why, _shm_fix(i, need))


def _shm_fix(i: Inputs, need: int, mount: bool = False) -> str:
    size = f"{max(1, -(-need // GIB))}G"
    where = (f"; to keep it, add `lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,size={size},create=dir 0 0` "
             f"to /etc/pve/lxc/{i.target.ctid}.conf") if i.node.pct else ""
    if mount:
        return f"in the container: mkdir -p /dev/shm && mount -t tmpfs -o size={size} tmpfs /dev/shm{where}"
    return f"in the container: mount -o remount,size={size} /dev/shm{where}"


def _model_dims(i: Inputs) -> dict | None:
    model = i.found.get("model")
    return model if model and "error" not in model else None


def disk_check(i: Inputs) -> Check:
    disk = i.found["disk"]
    if "error" in disk:
        return Check("disk at base_dir", FAIL, f"{disk['path']}: {disk['error']}", "a writable base_dir",
                     f"create {i.target.base_dir} in the container")
    if disk.get("writable") is False:
        where = disk.get("probed") or i.target.base_dir
        fix = (f"in the container: mount -o remount,rw the filesystem holding {where} (or give the container a "
               "writable volume there), or set base_dir in the inventory to a writable path") if disk.get("readonly") \
            else (f"in the container: make {where} writable for the login user (chown/chmod), or set base_dir in "
                  "the inventory to a writable path")
        state = "read-only" if disk.get("readonly") else "not writable"
        return Check("disk at base_dir", FAIL, f"{i.target.base_dir}: {state} ({disk.get('write_error')})",
                     "a writable base_dir", fix)
    size = i.plan.checkpoint_bytes(_model_dims(i))
    need = i.plan.disk_needed(_model_dims(i))
    measured = f"{gib(disk['free'])} free of {gib(disk['total'])} at {disk['measured_at']}"
    sized = need is not None
    if need is None:
        need = 1 * GIB
        why = "1.0 GiB (pass --config to size checkpoints)" if i.plan.config_path is None else \
            f"1.0 GiB (checkpoint size unknown: {(i.found.get('model') or {}).get('error', 'no model dims')})"
    else:
        why = f"{gib(need)}: {i.plan.keep_checkpoints}+1 checkpoints of {gib(size)} + 1 GiB"
    # Unsized (no config, or not the bundled trainer's): a guess, so it warns instead of refusing.
    return judged("disk at base_dir", disk["free"] >= need, measured, why,
                  f"free {gib(need - disk['free'])} under {i.target.base_dir}, lower run.keep_checkpoints, "
                  "or give the container a larger volume (pct resize / a mount point)", FAIL if sized else WARN)


def ram_check(i: Inputs) -> Check:
    mem = i.found.get("memory") or {}
    avail, total = mem.get("MemAvailable"), mem.get("MemTotal")
    need = i.plan.ram_needed(_model_dims(i))
    measured = f"{gib(avail)} available of {gib(total)}"
    cg = _cgroup_memory(i)
    if cg.get("limit") is not None and (total is None or cg["limit"] < total):
        # without lxcfs /proc/meminfo is the node's: the container's memory cgroup is what it gets
        cg_avail = max(0, cg["limit"] - (cg.get("usage") or 0))
        avail = cg_avail if avail is None else min(avail, cg_avail)
        measured = f"{gib(avail)} available of {gib(cg['limit'])} (the container's memory limit)"
    size = i.plan.checkpoint_bytes(_model_dims(i))
    why = f"{gib(need)}" + (f" (2 × {gib(size)} checkpoint + 2 GiB)" if size else " (2 GiB base)")
    if avail is None:
        return Check("RAM", WARN, "unknown (/proc/meminfo unreadable)", why)
    fix = f"on node {i.target.node.name}: pct set {i.target.ctid} --memory {-(-need // MIB) + 1024}" if i.node.pct \
        else "free memory on this machine"
    return judged("RAM", avail >= need, measured, why, fix)


def _limit(value: int | None) -> str:
    return "unlimited" if value is None else gib(value) if value >= MIB else f"{value // 1024} KiB"


def device_access_check(i: Inputs) -> Check | None:
    """The target's `user:` (a non-root user the runs are meant for) opens every NVIDIA device node."""
    found = i.found.get("device_access")
    if not found:
        return None
    user, t = found["user"], i.target
    needed = f"{user} opens /dev/nvidia* read-write"
    if found.get("error"):
        return Check("device access", FAIL, f"{user}: {found['error']}", needed,
                     f"create the user in CT {t.ctid}, or fix `user:` of {t.name} in the inventory")
    paths = found.get("paths") or {}
    denied = {p: why for p, why in paths.items() if why != "ok"}
    if not paths:
        return Check("device access", OK if not i.plan.needs_gpu else WARN, f"{user}: no /dev/nvidia* in the container",
                     needed, "" if not i.plan.needs_gpu else "see `gpu passthrough`")
    if not denied:
        return Check("device access", OK, f"{user}: {len(paths)} device node(s)", needed)
    listed = ", ".join(f"{p.rsplit('/', 1)[-1]} ({why})" for p, why in sorted(denied.items()))
    fix = (f"dflash-ops provision {t.name} --device-gid GROUP (a group {user} is in; --unprivileged maps it) "
           "--device-mode 0660 --yes" if i.node.pct else f"add {user} to the device nodes' group")
    return Check("device access", FAIL, f"{user}: {listed}", needed, fix)


def memlock_check(i: Inputs) -> Check:
    lim = i.found["limits"]["memlock"]
    measured = f"soft {_limit(lim['soft'])}, hard {_limit(lim['hard'])}"
    if not i.plan.needs_gpu:
        return Check("memlock limit", OK, measured, "any (CPU run)")
    if lim["soft"] is None:
        return Check("memlock limit", OK, measured, "unlimited")
    fix = (f"add `lxc.prlimit.memlock: unlimited` to /etc/pve/lxc/{i.target.ctid}.conf, then restart the CT"
           if i.node.pct else "ulimit -l unlimited (limits.conf: * - memlock unlimited)")
    return Check("memlock limit", WARN, measured, "unlimited (pinned buffers, NCCL)", fix)


def nofile_check(i: Inputs) -> Check:
    lim = i.found["limits"]["nofile"]
    measured = f"soft {lim['soft'] if lim['soft'] is not None else 'unlimited'}, hard {lim['hard'] or 'unlimited'}"
    fix = (f"add `lxc.prlimit.nofile: 1048576` to /etc/pve/lxc/{i.target.ctid}.conf, then restart the CT"
           if i.node.pct else "raise `ulimit -n` (limits.conf nofile)")
    return judged("open files limit", lim["soft"] is None or lim["soft"] >= NOFILE_MIN, measured, f">= {NOFILE_MIN}",
                  fix, WARN)


def clock_check(i: Inputs) -> Check:
    if i.clock is None:
        return Check("clock offset", WARN, "not measured", f"within {CLOCK_TOLERANCE_S:g} s")
    offset, error = i.clock
    measured = f"{offset:+.2f} s (± {error:.2f} s) vs this machine"
    where = f"node {i.target.node.name}" + (" (containers share the node's clock)" if i.node.pct else "")
    return judged("clock offset", abs(offset) - error <= CLOCK_TOLERANCE_S, measured, f"within {CLOCK_TOLERANCE_S:g} s",
                  f"enable NTP on {where} and on this machine: timedatectl set-ntp true", WARN)


@dataclass
class Report:
    target: str
    checks: list[Check]
    facts: dict | None = None
    fast: bool = False
    time: float = field(default_factory=time.time)

    @property
    def verdict(self) -> str:
        return verdict(self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    def to_json(self) -> dict:
        return {"target": self.target, "verdict": self.verdict, "fast": self.fast, "time": self.time,
                "checks": [asdict(c) for c in self.checks], "facts": self.facts}
