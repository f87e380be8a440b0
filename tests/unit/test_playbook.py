"""Playbook validation (every problem, with file:line) and variable substitution."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_ops.playbook.play import PlaybookError, load_playbook, substitute

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "book.yaml"
    path.write_text(text)
    return path


def problems(path: Path, **overrides) -> list[str]:
    with pytest.raises(PlaybookError) as info:
        load_playbook(path, overrides or None)
    return info.value.problems


@pytest.mark.parametrize("name", ["deploy.yaml", "train.yaml", "regen.yaml", "real-path.yaml"])
def test_shipped_playbooks_validate(name):
    book = load_playbook(REPO / "playbooks" / name)
    assert "deploy" in [step.type.name for step in book.steps]


def test_every_problem_is_reported_with_file_and_line(tmp_path):
    path = write(tmp_path, """\
name: bad
varz: {}
vars:
  keep: 3
steps:
  - deplyo: {}
  - exec: "python3 -c 'print(1)'"
  - exec:
      argv: [echo, "${kep}"]
      chek: true
  - sleep: {}
  - name: only a name
""")
    found = problems(path)
    assert f"{path}:2: unknown top-level key 'varz' (did you mean 'vars'?)" in found
    assert any(p.startswith(f"{path}:6: step 1: unknown step type 'deplyo' (did you mean 'deploy'?)") for p in found)
    assert any(p.startswith(f"{path}:7: step 2 (exec): argv must be a list") and "not a shell string" in p for p in found)
    assert f"{path}:9: undefined variable 'kep' (did you mean 'keep'?)" in found
    assert any(p.startswith(f"{path}:10: step 3 (exec): unknown parameter 'chek' (did you mean 'check'?)") for p in found)
    assert f"{path}:11: step 4 (sleep): missing required parameter 'seconds'" in found
    assert any(p.startswith(f"{path}:12: step 5: no step type") for p in found)
    assert len(found) == 7


def test_variables_from_earlier_steps_only(tmp_path):
    path = write(tmp_path, """\
steps:
  - exec: ["${release_python}", --version]
  - deploy: {}
  - exec: ["${release_python}", --version]
""")
    assert problems(path) == [f"{path}:2: undefined variable 'release_python' (did you mean 'python'?)"]


def test_var_overrides_and_types(tmp_path):
    path = write(tmp_path, "vars: {seconds: 1, word: hi}\nsteps:\n  - sleep: ${seconds}\n  - echo: 'say ${word} $${x}'\n")
    book = load_playbook(path, {"seconds": "0.5"})
    assert book.variables == {"seconds": 0.5, "word": "hi"}
    assert substitute(book.steps[0].params, book.variables) == {"seconds": 0.5}
    assert substitute(book.steps[1].params, book.variables) == {"message": "say hi ${x}"}
    assert problems(path, secnds="2") == [
        f"--var secnds: not a variable of {path} (did you mean 'seconds'?) (vars: seconds, word)"]


def test_invalid_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "steps:\n  - exec: [a, b\n  - sleep: 1\n")
    [problem] = problems(path)
    assert problem.startswith(f"{path}:3: invalid YAML")


def test_var_values_are_strings_unless_the_playbook_declares_a_type(tmp_path):
    """`--var` is not re-read as YAML: a string var gets the characters given; a var whose default
    is a number or true/false takes that type (decimal: 010 is 10, not octal 8) or is refused."""
    path = write(tmp_path, "vars: {name: tiny, count: 3, rate: 0.5, flag: false}\nsteps:\n  - echo: '${name}'\n")
    book = load_playbook(path, {"name": "010", "count": "010", "rate": "2", "flag": "True"})
    assert book.variables == {"name": "010", "count": 10, "rate": 2, "flag": True}
    for raw in ["no", "x # y", "[a, b]", "{k: v}", "1e3", "~", "", " padded "]:
        assert load_playbook(path, {"name": raw}).variables["name"] == raw
    assert load_playbook(path, {"rate": "1e-3"}).variables["rate"] == 0.001
    assert problems(path, count="ten", flag="no", rate="inf") == [
        "--var count=ten: not a number (the playbook's default is a number)",
        "--var flag=no: not true or false (the playbook's default is a boolean)",
        "--var rate=inf: not a number (the playbook's default is a number)"]
