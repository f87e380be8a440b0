"""Export a checkpoint as a published-format DFlash draft (config.json + model.safetensors).

The directory has the layout of z-lab's drafts (e.g. Qwen3-8B-DFlash-b16): a Qwen3 config
with `dflash_config` {mask_token_id, target_layer_ids}, `block_size` and `num_target_layers`,
and bf16 weights named fc, hidden_norm, layers.N.*, norm - what SGLang and vLLM load. For
`AutoModel.from_pretrained(dir, trust_remote_code=True)` it also carries the model code
(modeling_dflash.py + drafter.py, see trainer.models.hf_modeling) and config.json's `auto_map`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from trainer.run import checkpoint as ckpt
from trainer.run import destination
from trainer.run.layout import (
    Layout,
    LayoutError,
    engine_warnings,
    generation,
    published_fields,
    published_generation,
    resolve_published,
    run_checkpoint,
)

HERE = Path(__file__).resolve().parent
MASK_EMBEDDING = "mask_embedding.pt"  # a draft's separate mask embedding, as vLLM reads it
# file written beside the weights -> the trainer module it is a copy of
MODEL_CODE = {"modeling_dflash.py": HERE / "hf_modeling.py", "drafter.py": HERE / "drafter.py"}
DFLASH2_CODE = {"dflash2.py": HERE / "dflash2.py"}  # beside them in a DFlash2 export


def layout_of(d: dict) -> Layout:
    """The layout of a DrafterConfig dict (a checkpoint's drafter_config; older ones: the 2025 one)."""
    return Layout(d.get("layer_types"), d.get("sliding_window"), d.get("causal"), bool(d.get("attention_sink")))


def hf_config(d: dict, dtype: str = "bfloat16") -> dict:
    """The published config.json of a DrafterConfig dict: its layout in the fields vLLM resolves
    back to it (trainer.run.layout.published_fields)."""
    top, dflash = published_fields(layout_of(d), d["num_hidden_layers"])
    architectures, generation = published_generation(d)
    return {
        "architectures": architectures,
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": d["hidden_size"],
        "intermediate_size": d["intermediate_size"],
        "num_hidden_layers": d["num_hidden_layers"],
        "num_attention_heads": d["num_attention_heads"],
        "num_key_value_heads": d["num_key_value_heads"],
        "head_dim": d["head_dim"],
        "vocab_size": d["vocab_size"],
        "max_position_embeddings": d["max_position_embeddings"],
        "rms_norm_eps": d["rms_norm_eps"],
        "rope_theta": d["rope_theta"],
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        **top,
        "initializer_range": 0.02,
        "torch_dtype": dtype,
        "block_size": d["block_size"],
        "num_target_layers": d["num_target_layers"],
        "dflash_config": {"mask_token_id": d["mask_token_id"], "target_layer_ids": list(d["target_layer_ids"]),
                          **dflash, **generation},
        "auto_map": {"AutoModel": "modeling_dflash.DFlashDraftModel"},
    }


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                      force: bool = False) -> Path:
    """Write out_dir (atomically: built beside it, then renamed) from a trainer checkpoint.

    out_dir is replaced only as `built_beside` allows (an earlier export; `force`: an earlier
    output of another dflash-ops command; raises destination.Refused otherwise). Only the
    drafter's weights and config are read from the checkpoint."""
    out = Path(os.path.normpath(Path(out_dir).expanduser().absolute()))
    with built_beside(out, "export", force=force, check_only=True):
        pass  # refused before the checkpoint is read
    state = ckpt.load_weights(checkpoint_dir)
    d = state["drafter_config"]
    for warning in engine_warnings(layout_of(d), d["num_hidden_layers"]):
        print(f"export: warning: {warning}", file=sys.stderr)
    with built_beside(out, "export", force=force) as tmp:
        weights = {k: v.to(dtype).contiguous() for k, v in state["model"].items()}
        mask_embedding = weights.pop("mask_embedding", None)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if mask_embedding is not None:  # vLLM reads it from this file, not from the weights
            torch.save({"embedding": mask_embedding, "mask_token_id": d["mask_token_id"]}, tmp / MASK_EMBEDDING)
        name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
        (tmp / "config.json").write_text(json.dumps(hf_config(d, name), indent=2) + "\n")
        for written, source in {**MODEL_CODE, **(DFLASH2_CODE if d.get("kind") == "dflash2" else {})}.items():
            shutil.copyfile(source, tmp / written)
    return out


def _write_marker(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({**doc, "time": time.time()}, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def built_beside(out: Path, kind: str, *, force: bool = False, check_only: bool = False) -> Iterator[Path]:
    """A fresh directory beside `out` to write a model directory into; when the block ends without
    an error it is swapped in for `out`, so nobody loads a half-written one (on an error it is
    removed). `out` is replaced only as the replace rule allows (trainer/run/destination.py:
    absent, empty, or an earlier output of this `kind` - its marker `.NAME.dflash-KIND.json`
    beside it lists the files; `force`: also another command's output; raises
    destination.Refused). check_only: only the check."""
    out = Path(os.path.normpath(out.expanduser().absolute()))
    marker = destination.marker_path(str(out), kind)
    ours = destination.marker_files(destination.read_json(marker))
    refusal = destination.replace_refusal(str(out), kind, own=ours, force=force)
    if refusal:
        raise destination.Refused(refusal)
    if check_only:
        yield out
        return
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    _remove_stale_builds(out)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException as exc:
        disk = ckpt.disk_error(exc, tmp) if isinstance(exc, Exception) else None  # before the space is freed
        shutil.rmtree(tmp, ignore_errors=True)
        if disk is not None and disk is not exc:  # a full disk under safetensors / torch.save: an OSError
            raise disk from exc
        raise
    files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if not p.is_dir())
    # the marker names the old files too until the swap is done, so a crash between leaves them ours
    _write_marker(marker, {"files": files, "previous": sorted(ours or ())})
    aside = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists() or out.is_symlink():
        os.rename(out, aside)
    os.rename(tmp, out)
    _write_marker(marker, {"files": files})
    if aside.exists():
        shutil.rmtree(aside)


def _remove_stale_builds(out: Path) -> None:
    """The `.NAME.tmp-PID` directories a killed build of `out` left beside it (a whole model's size
    each): only that name, only when PID no longer writes it (trainer.run.checkpoint.writer_gone).
    `.NAME.old-PID` (the previous output, moved aside for the swap) is never removed here."""
    prefix = f".{out.name}.tmp-"
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return
    for p in entries:
        pid = p.name[len(prefix):]
        if p.name.startswith(prefix) and pid.isdigit() and p.is_dir() and not p.is_symlink() \
                and ckpt.writer_gone(int(pid), p):
            shutil.rmtree(p, ignore_errors=True)


def _read_checkpoint(d: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A trainer checkpoint directory (checkpoints/step-N: its drafter_config.json and weights) as
    read_published gives a published draft; an older checkpoint's missing fields are the defaults."""
    from trainer.models.drafter import DrafterConfig

    try:
        state = ckpt.load_weights(d)
        fields = DrafterConfig(**state["drafter_config"]).to_dict()
    except (ckpt.CheckpointError, TypeError, ValueError) as e:
        raise ValueError(f"{d}: not a usable trainer checkpoint ({e})") from None
    return fields, {k: v.float() for k, v in state["model"].items()}


def read_published(model_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A published-format draft directory (this exporter's, z-lab's, what SGLang and vLLM load)
    as (DrafterConfig fields, fp32 weights by the trainer's names): config.json's Qwen3 fields with
    `dflash_config` {mask_token_id, target_layer_ids} (older drafts: top-level `target_layer_ids`),
    and model.safetensors or shards listed by model.safetensors.index.json. A `model.` prefix
    (SpecForge's wrapper) is dropped; tensors the drafter does not own are left out. The layout
    (sliding/causal layers, sinks) is vLLM's reading of the config (trainer.run.layout), a
    mask_embedding.pt beside it the drafter's `mask_embedding`; what the trainer cannot train as
    served raises ValueError naming the field."""
    from safetensors.torch import load_file

    d = run_checkpoint(model_dir) or Path(model_dir)  # a run directory: its latest checkpoint
    if (d / ckpt.DRAFTER_CONFIG_FILE).is_file() and not (d / "config.json").is_file():
        return _read_checkpoint(d)
    try:
        config = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{d}: not a draft model directory (config.json: {e})") from None
    dflash = config.get("dflash_config") or {}
    layer_ids = dflash.get("target_layer_ids", config.get("target_layer_ids"))
    mask = dflash.get("mask_token_id", config.get("mask_token_id"))
    missing = [k for k, v in {"dflash_config.target_layer_ids": layer_ids, "dflash_config.mask_token_id": mask,
                              "block_size": config.get("block_size")}.items() if v is None]
    if missing:
        raise ValueError(f"{d}/config.json is not a DFlash draft: no {', '.join(missing)}")
    try:
        layout = resolve_published(config, f"{d}/config.json")
    except LayoutError as e:
        raise ValueError(f"cannot be trained as served: {e}") from None
    fields = {"hidden_size": config["hidden_size"], "intermediate_size": config["intermediate_size"],
              "num_hidden_layers": config["num_hidden_layers"],
              "num_attention_heads": config["num_attention_heads"],
              "num_key_value_heads": config.get("num_key_value_heads", config["num_attention_heads"]),
              "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
              "vocab_size": config["vocab_size"], "block_size": config["block_size"], "mask_token_id": mask,
              "target_layer_ids": list(layer_ids),
              "num_target_layers": config.get("num_target_layers"),
              "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
              "rope_theta": float((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 1e6))),
              "max_position_embeddings": config.get("max_position_embeddings", 40960),
              "layer_types": layout.layer_types, "sliding_window": layout.sliding_window, "causal": layout.causal,
              "attention_sink": layout.attention_sink, "mask_embedding": (d / MASK_EMBEDDING).is_file(),
              **generation(config)}
    index = d / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for name, tensor in load_file(str(d / f)).items():
            name = name.removeprefix("model.")
            if name.split(".")[0] in ("fc", "hidden_norm", "layers", "norm", "candidate_selector"):
                weights[name] = tensor.float()
    if fields["mask_embedding"]:  # a tensor, or {"embedding": tensor, "mask_token_id": id} (vLLM's two forms)
        state = torch.load(d / MASK_EMBEDDING, weights_only=True, map_location="cpu")
        if isinstance(state, dict):
            if state.get("mask_token_id", mask) != mask:
                raise ValueError(f"{d}/{MASK_EMBEDDING}: mask_token_id {state.get('mask_token_id')} is not "
                                 f"dflash_config.mask_token_id {mask}")
            state = state["embedding"]
        weights["mask_embedding"] = state.reshape(-1).float()
    return fields, weights
