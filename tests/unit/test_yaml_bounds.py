"""Every YAML reader of the project is bounded (trainer/run/yamlsafe.py): a few hundred bytes of
nested aliases, a recursive alias, a deep nest or a huge file is refused with file:line in one
line, instead of hanging (alias expansion is exponential for whoever walks the tree) or ending in
a RecursionError traceback."""

from __future__ import annotations

import pytest
import yaml

from dflash_ops.doctor.plan import plan_for
from dflash_ops.errors import DflashOpsError, InventoryError, UsageError
from dflash_ops.inventory import Node, Target, load_inventory
from dflash_ops.playbook.play import PlaybookError, load_playbook
from dflash_ops.playbook.run_steps import with_settings
from dflash_ops.runs.group import check_micro_batches
from trainer.run import yamlsafe

TARGET = Target(name="gpu200", node=Node(name="pve1", transport="ssh", pct=("pct",), address="10.0.0.1"),
                ctid=200, base_dir="/opt/dflash", gpus=(0,))


def laughs(levels: int, key: str = "steps") -> str:
    """Nine aliases per level: 9**levels leaves from ~60 bytes a level. `key` holds the last one
    (the line 'bomb' is on: 2 + levels)."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    lines.append(f"{key}: *a{levels}")
    return "\n".join(lines) + "\n"


BOMB = laughs(9)       # 9**9 = 387 million leaves in 540 bytes: hangs any unbounded walk
MIDDLE = laughs(5)     # 59049 leaves: unbounded readers accept it after a second; bounded ones refuse it


def test_the_rule_counts_what_aliases_add_and_names_the_line():
    assert len(BOMB) < 600
    with pytest.raises(yamlsafe.YAMLBoundError) as info:
        yamlsafe.compose(BOMB, "bomb.yaml")
    assert "aliases expand to more than 10000 nodes" in info.value.problem
    assert info.value.problem_mark.line + 1 == 5  # a1..a3 add 8289 nodes, the first *a3 of a4 7381 more
    # a modest use of aliases is fine, and the result is what PyYAML reads
    text = "base: &b {lr: 0.001, steps: 3}\nrun1: *b\nrun2: {<<: *b, steps: 4}\n"
    assert yamlsafe.safe_load(text) == yaml.safe_load(text)


@pytest.mark.parametrize("text, problem", [
    ("a: &a [1, *a]\n", "alias *a is inside the node it names (a recursive alias)"),
    ("a: &a {b: *a}\n", "alias *a is inside the node it names (a recursive alias)"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper than 64 levels"),
    ("a: " + "{b: " * 100 + "1" + "}" * 100 + "\n", "nested deeper than 64 levels"),
])
def test_recursion_and_depth_are_refused_not_a_traceback(text, problem):
    with pytest.raises(yamlsafe.YAMLBoundError) as info:
        yamlsafe.compose(text)
    assert info.value.problem == problem and info.value.problem_mark.line == 0


def test_size_is_bounded_before_reading_the_file(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("k: " + "x" * (yamlsafe.MAX_BYTES + 10) + "\n")
    with pytest.raises(yamlsafe.YAMLBoundError, match="more than 4194304 bytes"):
        yamlsafe.read_text(big)
    with pytest.raises(PlaybookError) as info:
        load_playbook(big)
    assert info.value.problems == [f"{big}: cannot read playbook: more than 4194304 bytes of YAML, more than this reader takes"]


@pytest.mark.parametrize("text", [BOMB, MIDDLE], ids=["bomb", "59049-leaves"])
def test_playbook_check(tmp_path, text):
    path = tmp_path / "book.yaml"
    path.write_text(text)
    with pytest.raises(PlaybookError) as info:
        load_playbook(path)
    [problem] = info.value.problems
    assert problem.startswith(f"{path}:") and "aliases expand to more than 10000 nodes" in problem


def test_playbook_with_a_recursive_alias(tmp_path):
    path = tmp_path / "book.yaml"
    path.write_text("steps: &s\n  - echo: hi\n  - exec: *s\n")
    with pytest.raises(PlaybookError) as info:
        load_playbook(path)
    assert info.value.problems == [f"{path}:3: invalid YAML: alias *s is inside the node it names (a recursive alias)"]


def test_inventory(tmp_path):
    path = tmp_path / "hosts.yaml"
    path.write_text(laughs(5, "nodes"))
    with pytest.raises(InventoryError, match=f"^{path}:[0-9]+: invalid YAML: aliases expand"):
        load_inventory(path)


@pytest.mark.parametrize("text", [BOMB, MIDDLE], ids=["bomb", "59049-leaves"])
def test_trainer_config_on_the_operator_side(tmp_path, text):
    """`run start --config` and `doctor --config` (plan_for), the playbook's `start: {set: ...}`
    and the run across hosts' micro-batch check all read the config."""
    path = tmp_path / "run.yaml"
    path.write_text("optim: {micro_batches: 3}\n" + text)
    with pytest.raises(UsageError, match=f"^{path}:[0-9]+: invalid YAML: aliases expand"):
        plan_for(TARGET, None, path)
    with pytest.raises(DflashOpsError, match=f"^{path}:[0-9]+: invalid YAML: aliases expand"):
        with_settings(path, {"train.total_steps": 3})
    check_micro_batches(path.read_bytes(), 2, str(path))  # the trainer reports it; no hang here


def test_a_plain_syntax_error_is_still_the_trainers_to_report(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train: [1, 2\n")
    assert plan_for(TARGET, None, path).config_error  # a warning, as before


@pytest.mark.parametrize("text", [BOMB, MIDDLE], ids=["bomb", "59049-leaves"])
def test_the_trainers_own_config_reader(tmp_path, text):
    """`python -m trainer`, `trainer plan` and `data-report` read a config through load_config."""
    from trainer.run.config import ConfigError, load_config

    path = tmp_path / "run.yaml"
    path.write_text("optim: {micro_batches: 3}\n" + text)
    with pytest.raises(ConfigError, match=f"^{path}:[0-9]+: invalid YAML: aliases expand"):
        load_config(path)
