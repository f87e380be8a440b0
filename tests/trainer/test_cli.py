"""`python -m trainer` as a new user meets it: --help names every command, each one answers --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import trainer
from trainer.__main__ import SUMMARIES, main

ROOT = Path(trainer.__file__).resolve().parents[1]


def test_help_lists_the_other_commands():
    out = subprocess.run([sys.executable, "-m", "trainer", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("plan", "data-report", "export", "synth", "launch"):
        assert f"python -m trainer {name} " in out.stdout


@pytest.mark.parametrize("name", sorted(SUMMARIES))
def test_every_listed_command_is_one(name, capsys):
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0
    assert f"python -m trainer {name}" in capsys.readouterr().out
