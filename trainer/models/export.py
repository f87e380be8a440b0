"""Export a checkpoint as a published-format DFlash draft (config.json + model.safetensors).

The directory has the layout of z-lab's drafts (e.g. Qwen3-8B-DFlash-b16): a Qwen3 config
with `dflash_config` {mask_token_id, target_layer_ids}, `block_size` and `num_target_layers`,
and bf16 weights named fc, hidden_norm, layers.N.*, norm - what SGLang and vLLM load. For
`AutoModel.from_pretrained(dir, trust_remote_code=True)` it also carries the model code and
config.json's `auto_map`: trainer.models.hf_modeling as modeling_dflash.py beside every trainer
module it reaches (drafter.py, dflash2.py, layout.py), their imports of each other made relative
(`model_code`), so the export loads where only torch and transformers are installed.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

from trainer.models.drafter import DrafterConfig
from trainer.run import checkpoint as ckpt
from trainer.run import destination
from trainer.run.contract import named_for
from trainer.run.layout import (
    MASK_EMBEDDING,
    LayoutError,
    engine_warnings,
    generation,
    published_fields,
    published_generation,
    resolve_published,
    run_checkpoint,
)

HERE = Path(__file__).resolve().parent
SOURCES = HERE.parents[1]  # the directory holding the trainer package
MODEL_ENTRY = "trainer.models.hf_modeling"  # the exported model's code (config.json's auto_map names it)
MODEL_FILE = "modeling_dflash"  # ... written as this module beside the weights
# what the exported code may import besides the files written beside it and the standard library
MODEL_CODE_PACKAGES = ("torch", "transformers")


def hf_config(c: DrafterConfig, dtype: str = "bfloat16") -> dict:
    """The published config.json of a drafter: its layout in the fields vLLM resolves back to it
    (trainer.run.layout.published_fields)."""
    top, dflash = published_fields(c.layout, c.num_hidden_layers)
    d = c.to_dict()
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
    c = DrafterConfig.from_dict(state["drafter_config"])
    for warning in engine_warnings(c.layout, c.num_hidden_layers):
        print(f"export: warning: {warning}", file=sys.stderr)
    with built_beside(out, "export", force=force) as tmp:
        weights = {k: v.to(dtype).contiguous() for k, v in state["model"].items()}
        mask_embedding = weights.pop("mask_embedding", None)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if mask_embedding is not None:  # vLLM reads it from this file, not from the weights
            torch.save({"embedding": mask_embedding, "mask_token_id": c.mask_token_id}, tmp / MASK_EMBEDDING)
        name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
        (tmp / "config.json").write_text(json.dumps(hf_config(c, name), indent=2) + "\n")
        for written, source in model_code().items():
            (tmp / written).write_text(source)
    return out


class ModelCodeError(ValueError):
    """A trainer module the exported model code reaches cannot stand alone beside the weights."""


def module_file(module: str, root: Path = SOURCES) -> Path:
    """The source file of a module under `root` (a package: its __init__.py)."""
    path = root.joinpath(*module.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"


def model_code(entry: str = MODEL_ENTRY, entry_as: str = MODEL_FILE, root: Path = SOURCES) -> dict[str, str]:
    """The exported model code, file name -> source: `entry` (as `entry_as`.py) and every module of
    its package that it imports, directly or through another, at the top or inside a function (each
    as its own file name, e.g. trainer.run.layout as layout.py).

    These are the trainer's own files, not a second copy to keep in step: each import of one of them
    becomes `from .NAME import ...`, the form transformers' dynamic-module loader follows and copies
    (it reads `from .NAME import` lines, one dot; 5.5 only the entry's own, so the entry imports every
    module itself). Every other import must be the standard library's
    or MODEL_CODE_PACKAGES', so the export loads where this repository is not installed; anything
    else raises ModelCodeError naming file:line, at export time rather than at the user's load."""
    package = entry.split(".")[0]
    names = {entry: entry_as}
    edits: dict[str, tuple[str, list[tuple[ast.ImportFrom, str]]]] = {}
    todo = [entry]
    while todo:
        module = todo.pop()
        path = module_file(module, root)
        text = path.read_text()
        own = []
        for node in ast.walk(ast.parse(text, str(path))):
            target = _own_import(module, path, node, package, root)
            if target is not None and isinstance(node, ast.ImportFrom):
                own.append((node, target))
                if target not in names:
                    names[target] = target.rsplit(".", 1)[-1]
                    todo.append(target)
        edits[module] = (text, own)
    written = sorted(names.values())
    clash = sorted({n for n in written if written.count(n) > 1})
    if clash:
        raise ModelCodeError(f"the exported model code would write two modules as {', '.join(clash)}.py")
    # transformers 5.5 (a declared floor) copies from a local directory only the files the entry imports
    # itself, so a module reached only through another would be missing at load
    unnamed = sorted(set(names) - {entry} - {target for _, target in edits[entry][1]})
    if unnamed:
        raise ModelCodeError(f"{module_file(entry, root)}: the exported model code needs {', '.join(unnamed)}, "
                             f"which {entry} does not import itself (transformers copies only what it imports)")
    return {f"{names[m]}.py": _made_relative(text, own, names) for m, (text, own) in sorted(edits.items())}


def _own_import(module: str, path: Path, node: ast.AST, package: str, root: Path) -> str | None:
    """The module of `package` an import statement of `module` takes names from (None: another
    package's, which must be one the exported code may import; ModelCodeError otherwise)."""
    if isinstance(node, ast.Import):
        imported = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        anchor = module.split(".")[: None if path.name == "__init__.py" else -1]
        anchor = anchor[: len(anchor) - max(node.level - 1, 0)] if node.level else []
        imported = [".".join([*anchor, *([node.module] if node.module else [])])]
    else:
        return None
    where = f"{path}:{node.lineno}"
    for name in imported:
        top = name.split(".")[0]
        if top == package:
            if isinstance(node, ast.Import) or module_file(name, root).name == "__init__.py":
                raise ModelCodeError(f"{where}: the exported model code takes {package}'s names only as "
                                     f"`from {package}.PACKAGE.MODULE import NAME` (here: {name})")
            return name
        if top not in MODEL_CODE_PACKAGES and top not in sys.stdlib_module_names:
            raise ModelCodeError(f"{where}: the exported model code may import only the standard library, "
                                 f"{', '.join(MODEL_CODE_PACKAGES)} and its own package's modules, not {name}")
    return None


def _made_relative(text: str, own: list[tuple[ast.ImportFrom, str]], names: dict[str, str]) -> str:
    """`text` with each import statement of `own` replaced by `from .NAME import ...` (the statement's
    span only: comments after it stay). ast's columns count UTF-8 bytes, so the edit is on bytes."""
    lines = text.encode().splitlines(keepends=True)
    for node, target in sorted(own, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        head, tail = lines[first][:node.col_offset], lines[last][node.end_col_offset:]
        if head.strip():  # transformers finds the files to copy by `^\s*from \.NAME import` lines
            raise ModelCodeError(f"line {node.lineno}: an import of {target} that does not begin its line")
        imported = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
        lines[first:last + 1] = [head + f"from .{names[target]} import {imported}".encode() + tail]
    return b"".join(lines).decode()


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
        disk = ckpt.disk_error(exc, out) if isinstance(exc, Exception) else None  # before the space is freed
        shutil.rmtree(tmp, ignore_errors=True)
        # a full disk under safetensors / torch.save: an OSError, naming `out`, not the build beside it
        shown = named_for(disk if disk is not None else exc, tmp, out)
        if shown is not exc:
            raise shown from exc
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


def _read_checkpoint(d: Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """A trainer checkpoint directory (checkpoints/step-N: its drafter_config.json and weights) as
    read_published gives a published draft; an older checkpoint's missing fields are the defaults."""
    from trainer.models.weights_check import float_weights

    try:
        state = ckpt.load_weights(d)
        config = DrafterConfig.from_dict(state["drafter_config"])
    except (ckpt.CheckpointError, TypeError, ValueError) as e:
        raise ValueError(f"{d}: not a usable trainer checkpoint ({e})") from None
    return config, float_weights(str(d), state["model"])


def _weight_files(d: Path) -> list[str]:
    """The safetensors files of a published draft directory: model.safetensors, or the shards its
    index lists; ValueError naming the directory when there are none (a config without weights)."""
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    else:
        files = ["model.safetensors"]
    for f in files:
        if not (d / f).is_file():
            raise ValueError(f"{d}: no {f} (the draft's weights)")
    return files


def read_published(model_dir: str | Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """A published-format draft directory (this exporter's, z-lab's, what SGLang and vLLM load)
    as (its DrafterConfig, fp32 weights by the trainer's names): config.json's Qwen3 fields with
    `dflash_config` {mask_token_id, target_layer_ids} (older drafts: top-level `target_layer_ids`),
    and model.safetensors or shards listed by model.safetensors.index.json. A `model.` prefix
    (SpecForge's wrapper) is dropped; tensors the drafter does not own are left out. The layout
    (sliding/causal layers, sinks) is vLLM's reading of the config (trainer.run.layout), a
    mask_embedding.pt beside it the drafter's `mask_embedding`; what the trainer cannot train as
    served raises ValueError naming the field."""
    from safetensors.torch import load_file

    from trainer.models.weights_check import float_weights

    d = run_checkpoint(model_dir) or Path(model_dir)  # a run directory: its latest checkpoint
    if (d / ckpt.DRAFTER_CONFIG_FILE).is_file() and not (d / "config.json").is_file():
        return _read_checkpoint(d)
    try:
        raw = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{d}: not a draft model directory (config.json: {e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{d}: not a draft model directory (config.json holds a JSON {type(raw).__name__}, "
                         "not an object)")
    config: Any = raw
    dflash: dict = config["dflash_config"] if isinstance(config.get("dflash_config"), dict) else {}
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
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(config.get(key), int) or isinstance(config[key], bool) or config[key] < 1:
            raise ValueError(f"{d}/config.json: {key} is {config.get(key, 'missing')!r}, not a positive integer "
                             "(not a DFlash draft's config)")
    fields: dict[str, Any] = {
              "hidden_size": config["hidden_size"], "intermediate_size": config["intermediate_size"],
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
              "layout": layout, "mask_embedding": (d / MASK_EMBEDDING).is_file(), **generation(config)}
    try:
        published = DrafterConfig(**fields)
    except ValueError as e:
        raise ValueError(f"{d}/config.json: cannot be trained as served: {e}") from None
    weights: dict[str, torch.Tensor] = {}
    for f in _weight_files(d):
        try:
            tensors = load_file(str(d / f))
        except Exception as e:  # noqa: BLE001 - safetensors' own error type (a truncated or foreign file)
            raise ValueError(f"{d / f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
        owned = {name.removeprefix("model."): t for name, t in tensors.items()
                 if name.removeprefix("model.").split(".")[0] in ("fc", "hidden_norm", "layers", "norm", "candidate_selector")}
        weights.update(float_weights(str(d / f), owned))
    if published.mask_embedding:
        from trainer.models.hf_modeling import load_mask_embedding

        weights["mask_embedding"] = load_mask_embedding(d / MASK_EMBEDDING, mask)
    return published, weights
