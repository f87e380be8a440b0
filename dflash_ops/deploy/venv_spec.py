"""Local side of a target's venv: its configuration, its lock hash, the stream that builds it.

The lock hash covers everything that decides the venv's content (requirements text, whether
it sees the container's own packages, the wheelhouse's files), so `venvs/<lock-hash>` is
reused exactly when nothing of that changed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from dflash_ops.deploy.manifest import trainer_dir
from dflash_ops.errors import UsageError
from dflash_ops.tarstream import build_tar

UV_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class VenvSpec:
    """How a target's venv is built (inventory key `venv:`).

    requirements: the requirements file (default: the trainer's requirements.txt).
    system_site_packages: let the venv see the container's own packages (its CUDA torch).
    wheelhouse: a local directory of wheels, pushed and installed with --no-index.
    uv: "auto" uses uv when the container has it, "always" requires it, "never" uses pip.
    index: whether pip may reach a package index (False: --no-index without a wheelhouse).
    """

    requirements: Path | None = None
    system_site_packages: bool = True
    wheelhouse: Path | None = None
    uv: str = "auto"
    index: bool = True

    def __post_init__(self) -> None:
        if self.uv not in UV_MODES:
            raise UsageError(f"venv uv must be one of {UV_MODES}, got {self.uv!r}")

    def requirements_file(self) -> Path:
        return Path(self.requirements) if self.requirements else trainer_dir() / "requirements.txt"

    def wheels(self) -> list[Path]:
        if self.wheelhouse is None:
            return []
        wheelhouse = Path(self.wheelhouse)
        if not wheelhouse.is_dir():
            raise FileNotFoundError(f"venv wheelhouse is not a directory: {wheelhouse}")
        return sorted(p for p in wheelhouse.iterdir() if p.is_file())

    def lock_hash(self) -> str:
        requirements = self.requirements_file().read_text()
        lines = sorted(line.split("#", 1)[0].strip() for line in requirements.splitlines())
        blob = json.dumps({
            "requirements": [line for line in lines if line],
            "system_site_packages": self.system_site_packages,
            "wheels": [(p.name, p.stat().st_size) for p in self.wheels()],
        }, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def rel_path(self) -> str:
        return f"venvs/{self.lock_hash()}"

    def helper_args(self, base_dir: str) -> list[str]:
        args = ["ensure", base_dir, self.lock_hash(), "--uv", self.uv]
        if self.system_site_packages:
            args.append("--system-site-packages")
        if not self.index:
            args.append("--no-index")
        return args

    def tar(self) -> IO[bytes]:
        entries = [("requirements.txt", self.requirements_file())]
        entries += [(f"wheels/{p.name}", p) for p in self.wheels()]
        return build_tar(entries)

    @classmethod
    def from_config(cls, config: dict | None, *, base: Path | None = None) -> "VenvSpec":
        """From an inventory/playbook `venv:` mapping; relative paths resolve against `base`."""
        config = dict(config or {})
        unknown = set(config) - {"requirements", "system_site_packages", "wheelhouse", "uv", "index"}
        if unknown:
            raise UsageError(f"venv: unknown key(s) {sorted(unknown)}")

        def path(key: str) -> Path | None:
            value = config.get(key)
            if value is None:
                return None
            p = Path(value).expanduser()
            return p if p.is_absolute() or base is None else base / p

        return cls(requirements=path("requirements"),
                   system_site_packages=bool(config.get("system_site_packages", True)),
                   wheelhouse=path("wheelhouse"), uv=str(config.get("uv", "auto")),
                   index=bool(config.get("index", True)))
