"""The transformers floors the project declares, one line each: `NAME PIN PIN ...` (.ci/deps-venv).

  the project's floor: pyproject's trainer extra, transformers, safetensors and tokenizers each at
      its `>=` version (trainer.run.family.TRANSFORMERS_FLOOR says the same; a test holds them equal);
  each family's own minimum (trainer.run.family.TRANSFORMERS_MIN): that transformers, with the
      safetensors and tokenizers pip picks for it (5.14 needs a newer safetensors than 5.5 does).
torch is the test venv's version (.ci/deps-venv says why)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.run.family import TRANSFORMERS_MIN, version_tuple  # noqa: E402  (stdlib only)


def declared_floors(pyproject: str) -> dict[str, str]:
    """name -> its `>=` version in pyproject's trainer extra (`trainer = [ "name>=X",  # ... ]`)."""
    block = re.search(r"^trainer = \[(.*?)^\]", pyproject, re.M | re.S)
    assert block, "pyproject.toml: no trainer extra"
    return dict(re.findall(r'^\s*"([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)"', block.group(1), re.M))


def floor_pins(pyproject: str) -> list[tuple[str, list[str]]]:
    """(venv name, pip pins) per floor: the project's first, then each family minimum, oldest first."""
    floors = declared_floors(pyproject)
    out = [(f"transformers-{floors['transformers']}",
            [f"{name}=={floors[name]}" for name in ("transformers", "safetensors", "tokenizers")])]
    for need in sorted(set(TRANSFORMERS_MIN.values()), key=version_tuple):
        out.append((f"transformers-{need}", [f"transformers=={need}"]))
    return out


def main() -> None:
    for name, pins in floor_pins((REPO / "pyproject.toml").read_text()):
        print(name, *pins)


if __name__ == "__main__":
    main()
