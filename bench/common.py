"""What several bench scripts share: the random hub-format target they load, and how they report."""

from __future__ import annotations

import json
import time
from pathlib import Path


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
