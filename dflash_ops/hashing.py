"""Content hashes of local files (releases, transfer checks, pulled checkpoints): the helpers' own
sha256_file (dflash_ops/helpers/nodefacts.py, stdlib only), so a file hashes the same way on the
operator's machine and in the container."""

from __future__ import annotations

from pathlib import Path

from dflash_ops.helpers import nodefacts


def sha256_file(path: Path | str) -> str:
    return nodefacts.sha256_file(str(path))
