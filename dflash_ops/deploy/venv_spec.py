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
from typing import IO, get_args

from pydantic import ValidationError

from dflash_ops.deploy.manifest import trainer_dir
from dflash_ops.errors import UsageError
from dflash_ops.helpers import venvs
from dflash_ops.inventory import UvMode, VenvConfig, schema_problem
from dflash_ops.tarstream import build_tar

UV_MODES: tuple[str, ...] = get_args(UvMode)


@dataclass(frozen=True)
class VenvSpec:
    """How a target's venv is built (inventory key `venv:`, schema inventory.VenvConfig).

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
        return venvs.rel_path(self.lock_hash())

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
        """From an inventory/playbook `venv:` mapping (checked against VenvConfig: a wrong key or
        type is a one-line UsageError); relative paths resolve against `base`."""
        try:
            checked = VenvConfig.model_validate(dict(config or {}))
        except ValidationError as e:
            raise UsageError(f"venv: {schema_problem(VenvConfig, e)[2]}") from None

        def path(value: str | None) -> Path | None:
            if value is None:
                return None
            p = Path(value).expanduser()
            return p if p.is_absolute() or base is None else base / p

        return cls(requirements=path(checked.requirements), system_site_packages=checked.system_site_packages,
                   wheelhouse=path(checked.wheelhouse), uv=checked.uv, index=checked.index)
