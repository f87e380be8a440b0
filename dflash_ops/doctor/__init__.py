"""`dflash-ops doctor`: can this container run the trainer? Measured before the GPU hours.

One pass per target: the node's facts (`pct status` + `pct config`, one round trip) and one
call of the stdlib helper `doctor` in the container, which measures everything else and runs
a tiny NCCL all-reduce under the venv's python. `checks.evaluate` judges; docs/doctor.md
lists every check with its threshold and why.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from dflash_ops.doctor.checks import Inputs, Report, evaluate
from dflash_ops.doctor.node import NodeFacts, node_facts
from dflash_ops.doctor.plan import RunPlan, plan_for
from dflash_ops.doctor.verdicts import last_verdict, record_verdict
from dflash_ops.errors import DflashOpsError, TransferError, TransportError
from dflash_ops.runs import list_runs

if TYPE_CHECKING:
    from dflash_ops.container import Container, ContainerAPI

HELPER = "doctor"
PROBE_TIMEOUT_S = 120.0  # torch import + CUDA init + NCCL init on a cold container
FAST_PROBE_TIMEOUT_S = 60.0
FALLBACK_HELPERS = "/tmp/dflash-ops-helpers"  # where the doctor runs from when base_dir cannot be written

__all__ = ["Report", "RunPlan", "diagnose", "last_verdict", "plan_for", "preflight", "record_verdict",
           "unreachable_report"]


def helper_args(container: ContainerAPI, plan: RunPlan, fast: bool) -> list[str]:
    target = container.target
    torch_mode = "full" if (plan.needs_gpu or not fast) else "find"
    args = ["facts", "--base", container.base_dir, "--python", target.python,
            "--gpus", ",".join(str(g) for g in plan.gpus), "--torch", torch_mode,
            "--runs-helper", container.helper_path("runs"),
            "--probe-timeout", f"{FAST_PROBE_TIMEOUT_S if fast else PROBE_TIMEOUT_S:g}",
            "--root", target.node.kind.container_root(target.ctid) if target.node.pct else "/"]
    if plan.needs_gpu and not fast:
        args.append("--nccl")
    user = getattr(target, "user", None)
    if user:
        args += ["--device-user", user]
    if plan.model_config_path:
        args += ["--model-config", plan.model_config_path]
    return args


def diagnose(container: Container, plan: RunPlan | None = None, fast: bool = False) -> Report:
    """One doctor pass over `container` for a run described by `plan` (default: the target's GPUs)."""
    target = container.target
    plan = plan or plan_for(target)
    node = node_facts(target, container.transport)
    inputs = Inputs(target=target, plan=plan, node=node, fast=fast)
    if node.state == "running":
        _gather(container, plan, fast, inputs)
    return Report(target.name, evaluate(inputs), inputs.facts, fast)


def _gather(container: ContainerAPI, plan: RunPlan, fast: bool, inputs: Inputs) -> None:
    sent = time.time()
    first: list[float] = []

    def on_line(line: bytes) -> None:
        if not first:
            first.append(time.time())

    try:
        try:
            result = container.helper(HELPER, helper_args(container, plan, fast), on_line=on_line,
                                      timeout=PROBE_TIMEOUT_S + 120)
        except TransferError:  # base_dir cannot take the helper (read-only, not writable): its facts say why
            result = container.helper(HELPER, helper_args(container, plan, fast), on_line=on_line,
                                      timeout=PROBE_TIMEOUT_S + 120, helpers_root=FALLBACK_HELPERS)
    except TransportError as e:
        inputs.helper_error = str(e)
        return
    docs = []
    for line in result.stdout.splitlines():
        try:
            docs.append(json.loads(line))
        except ValueError:
            continue
    if not result.ok or len(docs) < 2:
        said = (result.stderr.strip() or result.stdout.strip()).splitlines()
        inputs.helper_error = f"{container.target.python}: exit {result.exit_code}" + (f": {said[-1]}" if said else "")
        return
    clock, facts = docs[0].get("clock"), docs[-1]
    if isinstance(clock, (int, float)) and first:
        inputs.clock = (clock - (sent + first[0]) / 2, (first[0] - sent) / 2)
    if "missing" in (facts.get("runs") or {}):
        facts["runs"] = _runs_fallback(container)
    inputs.facts = facts


def _runs_fallback(container: ContainerAPI) -> dict:
    """The runs helper of this version was not installed yet: ask it (this installs it)."""
    try:
        runs = list_runs(container)
    except DflashOpsError as e:
        return {"error": str(e)}
    return {"live": [{"run_id": r.run_id, "pid": r.pid, "gpus": list(r.gpus)}
                     for r in runs if r.alive and not r.final]}


def unreachable_report(container: ContainerAPI, error: Exception) -> Report:
    """The report of a target whose node could not be reached (or whose pass raised)."""
    state = "unreachable" if isinstance(error, TransportError) else "unknown"
    node = NodeFacts(bool(container.target.node.pct), state, str(error))
    inputs = Inputs(target=container.target, plan=plan_for(container.target), node=node)
    report = Report(container.target.name, evaluate(inputs))
    record_verdict(container.target, report)
    return report


def preflight(container: Container, plan: RunPlan) -> Report:
    """The fast subset `run start` runs first (no NCCL all-reduce; torch imported only for GPU runs)."""
    report = diagnose(container, plan, fast=True)
    record_verdict(container.target, report)
    return report
