"""What several bench scripts share: the random hub-format target they load, how they report, and
their presets' --set overrides."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Container, Sequence
from pathlib import Path
from typing import Any

import yaml


def hub_model_dir(model_dir: Path, shape: str, device: str, out: dict) -> Path:
    """`model_dir` as a Qwen3 hub-format target of `shape` ("8b" or "tiny"), random weights in 4 GiB
    shards: reused when it has a config.json, else written, with the time taken in out."""
    if not (model_dir / "config.json").exists():
        from trainer_tools.fixtures.hub_model import (  # torch: only when needed
            QWEN3_8B_DIMS,
            TINY_DIMS,
            write_hub_model,
        )

        began = time.perf_counter()
        write_hub_model(model_dir, "qwen3", dims=QWEN3_8B_DIMS if shape == "8b" else TINY_DIMS, shards=None,
                        max_shard_bytes=4 << 30, device=device)
        out["write_model_dir_s"] = round(time.perf_counter() - began, 1)
    return model_dir


def report(out: dict, path: Path | None) -> dict:
    """Print the figures as indented JSON, and write them to `path` (--out) when given."""
    text = json.dumps(out, indent=1)
    print(text, flush=True)
    if path:
        path.write_text(text)
    return out


def apply_sets(ap: argparse.ArgumentParser, preset: Any, items: list[str],
               tuple_fields: Container[str] | None = None) -> None:
    """--set KEY=VALUE overrides (each VALUE read as YAML) onto the preset dataclass; a list becomes a tuple
    (for every field, or only those in `tuple_fields`). An unknown field is refused (ap.error), naming
    the fields there are. A number field takes what float() reads too: YAML 1.1 reads `2e-3` as a string."""
    known = {f.name for f in dataclasses.fields(preset)}
    for item in items:
        key, _, value = item.partition("=")
        if key not in known:
            ap.error(f"--set {item}: no preset field {key!r} (known: {', '.join(sorted(known))})")
        v = yaml.safe_load(value)
        now = getattr(preset, key)
        if isinstance(now, float) and isinstance(v, (str, int)) and not isinstance(v, bool):
            try:
                v = float(v)
            except ValueError:
                ap.error(f"--set {item}: {key} is a number, not {value!r}")
        as_tuple = isinstance(v, list) and (tuple_fields is None or key in tuple_fields)
        setattr(preset, key, tuple(v) if as_tuple else v)


def seeds_refused(seeds: Sequence[Any]) -> str | None:
    """Why a preset's seeds cannot seed runs (each an integer, each once: a seed names its runs); None when
    they can."""
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        return f"seeds {list(seeds)}: integers only"
    return named_twice("seeds", seeds)


def named_twice(field: str, values: Sequence[Any]) -> str | None:
    """Why a list of a preset's run names (objectives, candidates, seeds) cannot be run: a value named twice
    would name two runs alike, and a run's name is its directory. None when each is named once."""
    repeated = sorted({str(v) for v in values if list(values).count(v) > 1})
    return f"{field} {list(values)}: {', '.join(repeated)} named twice" if repeated else None
