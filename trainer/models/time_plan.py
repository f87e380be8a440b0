"""The time plan: how many tokens a config trains, at what rate on its devices, in how long and for
how many GPU-hours (`python -m trainer plan` prints it beside the memory plan).

The throughput model is calibrated on the bench's measured figures (bench/RESULTS.md, one H200,
torch 2.11): the Qwen3-8B-shaped target with the 5-layer drafter, block 16, packed rows of 8,192,
compiled target, steady real tokens/s of the whole pipeline on one shared GPU (REFERENCE), and the
two stages measured alone in the same runs (target 41,064 tok/s, drafter 22,629 tok/s in bf16). A
config's rate is then:

* the stage rates scaled by size: the target's by the weights of the layers training runs (the
  memory plan's stage weights), the drafter's by its parameters, each against the reference shape
  built the same way (FLOPs per token go with parameters);
* placed on the layout: each device carries its share of the target (1 / replicas, split by stage
  weights) and of the drafter (1 / drafter replicas); the rate is what the busiest device allows,
  times the pipeline's overlap on the reference (measured / the shared-GPU bound 1/(1/t+1/d));
* bucketed rows (no data.pack_length) at 1/3.06 of packed (issue #13: 4,425 vs 13,535 tok/s).

An H100 has the H200's dense peak (989 TFLOP/s) and less memory bandwidth: its figures here are the
H200's, marked as estimates until a `--calibrate` run on one is recorded. `--calibrate N` replaces
the model by N steps of the config itself on this host's devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from trainer.run.config import DrafterShapeConfig, TargetConfig, TrainerConfig, target_replicas

# Steady real tokens/s on one shared GPU, the reference shape (bench/RESULTS.md "2026-12-03, 1 x H200":
# bf16 15,045, fp8 16,962, fp8 + fast accumulation 17,232) and the stages alone (issue #13 packed+ct:
# target 41,064 at MFU 0.60; drafter 22,629). The FP8 target alone scales with its MFU (0.88, 0.94).
REFERENCE = {"bf16": 15045.0, "fp8": 16962.0, "fp8_fast": 17232.0}
TARGET_ALONE = {"bf16": 41064.0, "fp8": 41064.0 * 0.88 / 0.60, "fp8_fast": 41064.0 * 0.94 / 0.60}
DRAFTER_ALONE = 22629.0
BUCKETED_FACTOR = 4425.0 / 13535.0  # issue #13: length buckets vs packed rows, same data
PAD_SHARE = {"packed": 0.0065, "bucketed": 0.509}  # share of computed positions that are padding (issue #13)
MEASURED_KINDS = {"h200": "measured on one H200 (bench/RESULTS.md)",
                  "h100": "the H200's figures (same 989 TFLOP/s peak; not measured on an H100: --calibrate)"}
STARTUP_S = 120.0  # load, tokenise, compile and warm up: 1-2 minutes on the 8B in the bench's runs


class NoThroughput(ValueError):
    """No throughput figure for these devices (the CPU): --calibrate N measures one."""


@dataclass
class TimePlan:
    steps: int
    positions_per_step: int  # token positions a step computes (padding included)
    tokens: int  # real tokens the run trains (positions less the pad share)
    tokens_per_s: float
    gpus: int  # GPUs the layout holds
    gpu_kind: str
    basis: str  # where the rate comes from
    notes: list[str] = field(default_factory=list)
    data_tokens: int | None = None  # the training data's tokens after truncation (plan --data), else unknown
    data_conversations: int | None = None

    @property
    def train_seconds(self) -> float:
        return self.tokens / self.tokens_per_s

    @property
    def wall_seconds(self) -> float:
        return self.train_seconds + STARTUP_S

    @property
    def gpu_hours(self) -> float:
        return self.wall_seconds / 3600 * max(self.gpus, 1)


def positions_per_step(cfg: TrainerConfig) -> int:
    d = cfg.data
    return cfg.optim.micro_batches * (d.pack_rows * d.pack_length if d.pack_length else d.token_budget)


def gpu_devices(cfg: TrainerConfig) -> list[str]:
    """The distinct CUDA devices the layout holds."""
    every = [d for replica in target_replicas(cfg.devices) for d in replica] + list(cfg.devices.drafter)
    return list(dict.fromkeys(d if ":" in d else d + ":0" for d in every if d.startswith("cuda")))


def precision_key(cfg: TrainerConfig) -> str:
    t = cfg.model.target
    return "bf16" if t.precision != "fp8" else ("fp8_fast" if t.fp8_fast_accum else "fp8")


def reference_config(cfg: TrainerConfig) -> TrainerConfig:
    """The bench's reference shape on this config's devices and precision: the sizes the rates scale from."""
    t = TargetConfig(random_8b_shape=True, precision=cfg.model.target.precision)
    model = dataclasses.replace(cfg.model, target=t, drafter_layers=5, drafter=DrafterShapeConfig(), block_size=16,
                                num_target_layers=5, target_layer_ids=None, drafter_init=None)
    return dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, synthetic=None, pack_length=8192,
                                                                         pack_rows=1))


def _sizes(cfg: TrainerConfig) -> tuple[list[tuple[str, int]], int]:
    """(device, target weight bytes) of replica 0's stages, and the drafter's weight bytes, from the
    memory plan (no weights read)."""
    from trainer.models.memory_plan import build_plan

    plan = build_plan(cfg)
    return [(st["device"], int(st["target weights"])) for st in plan.stages], 4 * plan.drafter_params


def model_rate(cfg: TrainerConfig, notes: list[str]) -> float:
    """Real tokens/s the throughput model gives this config on its devices (module doc)."""
    if not gpu_devices(cfg):
        raise NoThroughput("no throughput figure for the CPU: measure it with --calibrate N")
    key = precision_key(cfg)
    ref_stages, ref_drafter = _sizes(reference_config(cfg))
    try:
        stages, drafter = _sizes(cfg)
    except (OSError, ValueError) as exc:  # no model directory here (a fresh clone): the reference shape
        notes.append(f"target not sized ({exc}): its rate is the reference 8B shape's")
        stages, drafter = ref_stages, ref_drafter
    target_rate = TARGET_ALONE[key] * sum(w for _, w in ref_stages) / max(sum(w for _, w in stages), 1)
    drafter_rate = DRAFTER_ALONE * ref_drafter / max(drafter, 1)
    overlap = REFERENCE[key] / (1 / (1 / TARGET_ALONE[key] + 1 / DRAFTER_ALONE))
    load: dict[str, float] = {}
    replicas = target_replicas(cfg.devices)
    total_weight = max(sum(w for _, w in stages), 1)
    for replica in replicas:
        for i, device in enumerate(replica):
            share = stages[i][1] / total_weight if i < len(stages) else 1 / len(replica)
            load[device] = load.get(device, 0.0) + share / len(replicas) / target_rate
    for device in cfg.devices.drafter:
        load[device] = load.get(device, 0.0) + 1 / len(cfg.devices.drafter) / drafter_rate
    rate = overlap / max(load.values())
    if not cfg.data.pack_length:
        rate *= BUCKETED_FACTOR
        notes.append("length buckets (no data.pack_length): 1/3.06 of packed rows' rate, as measured (issue #13)")
    if any(len(r) > 1 for r in replicas):
        notes.append("a target split in stages: the hand-off between stages is not modelled (measured 0.997x on one H200)")
    if cfg.optim.offload != "none":
        notes.append(f"optim.offload {cfg.optim.offload}: the update on the host's CPU and its copies are not modelled "
                     "(--calibrate measures them)")
    return rate


def gpu_kind_here() -> str | None:
    """h100 or h200 from this host's first GPU's name, else None."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name(0).upper()
    except Exception:  # noqa: BLE001 - no usable CUDA: plan for the named kind
        return None
    return "h200" if "H200" in name else "h100" if "H100" in name else None


def build_time_plan(cfg: TrainerConfig, gpu_kind: str | None = None, measured: dict | None = None,
                    data: tuple[int, int] | None = None) -> TimePlan:
    """gpu_kind: h100 | h200 (default this host's, else h200); measured: a calibration's
    {"tokens_per_s", "pad_share", "steps"} (calibrate), which replaces the model; data: the training
    data's (conversations, tokens after truncation), for the epochs the run covers."""
    notes: list[str] = []
    kind = gpu_kind or gpu_kind_here()
    if kind is None:
        kind = "h200"
        if measured is None and gpu_devices(cfg):
            notes.append("no H100 or H200 on this host: planned for an H200 (--gpu h100 for an H100)")
    positions = positions_per_step(cfg)
    if measured is not None:
        rate = float(measured["tokens_per_s"])
        pad = float(measured.get("pad_share") or 0.0)
        basis = f"measured: {measured['steps']} steps of this config on this host (--calibrate)"
    else:
        rate = model_rate(cfg, notes)
        pad = PAD_SHARE["packed" if cfg.data.pack_length else "bucketed"]
        basis = f"model: {MEASURED_KINDS[kind]}, scaled to this config's shape and devices"
    tokens = round(cfg.optim.total_steps * positions * (1 - pad))
    return TimePlan(steps=cfg.optim.total_steps, positions_per_step=positions, tokens=tokens, tokens_per_s=rate,
                    gpus=len(gpu_devices(cfg)), gpu_kind=kind, basis=basis, notes=notes,
                    data_conversations=None if data is None else data[0], data_tokens=None if data is None else data[1])


def duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def format_time_plan(p: TimePlan) -> str:
    gpus = f"{p.gpus} x {p.gpu_kind.upper()}" if p.gpus else "the CPU"
    lines = [
        "time and cost:",
        f"  tokens: {p.tokens:,} real ({p.steps:,} steps x {p.positions_per_step:,} positions a step, less padding)",
        *([f"  data: {p.data_tokens:,} tokens in {p.data_conversations:,} conversations: the run covers "
           f"{p.tokens / p.data_tokens:.2f} epochs"] if p.data_tokens else []),
        f"  rate: {p.tokens_per_s:,.0f} real tokens/s on {gpus} ({p.basis})",
        f"  wall time: {duration(p.wall_seconds)} ({duration(p.train_seconds)} training + ~{duration(STARTUP_S)} start-up)",
        f"  GPU-hours: {p.gpu_hours:.1f}" + (f" ({p.gpus} GPUs x {p.wall_seconds / 3600:.2f} h)" if p.gpus else ""),
    ]
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)


def calibrate(cfg: TrainerConfig, steps: int, train: Callable[[TrainerConfig, str], int]) -> dict:
    """Train `steps` steps of this config in a throw-away run directory on this host's devices and
    return {"tokens_per_s", "pad_share", "steps"} from its status.json (the steady rate, else the
    last window's). The final evaluation is shrunk to one short prompt. train: trainer.entry.train
    (passed in: the entry point stands above this module)."""
    import json
    import tempfile

    short = dataclasses.replace(
        cfg, optim=dataclasses.replace(cfg.optim, total_steps=steps),
        run=dataclasses.replace(cfg.run, log_every=max(1, steps // 4), checkpoint_every=0, wandb=None),
        eval=dataclasses.replace(cfg.eval, every=0, samples=1, max_new_tokens=1))
    with tempfile.TemporaryDirectory(prefix="dflash-calibrate-") as tmp:
        code = train(short, tmp + "/run")
        status = json.loads(open(tmp + "/run/status.json").read())
    rate = status.get("tokens_per_s_steady") or status.get("tokens_per_s")
    if code != 0 or not rate:
        error = (status.get("error") or {}).get("message")
        raise ValueError(f"the calibration run did not measure a rate ({status.get('state')}: {error})")
    return {"tokens_per_s": rate, "pad_share": status.get("pad_share"), "steps": steps}
