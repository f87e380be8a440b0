"""Every YAML the tool writes reads back as itself under YAML 1.1, whose booleans are
y|Y|yes|Yes|YES|n|N|no|No|NO|true|...|on|On|ON|off|Off|OFF: a string among them is written quoted
(#55 item 8). PyYAML quoted yes/no/on/off but left y / n plain; a YAML 1.1 reader of another tool
(Go's yaml.v2, for one) reads those back as booleans. One round trip per writer."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from trainer.run import yamlsafe

WORDS = ["y", "Y", "n", "N", "yes", "No", "on", "OFF", "true", "null", "~", "1", "0x1f", "1e3", "plain"]


class Yaml11Loader(yaml.SafeLoader):
    """A reader with the YAML 1.1 spec's whole boolean set (PyYAML's lacks y / n)."""


Yaml11Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"), list("yYnN"))


def read11(text: str):
    return yaml.load(text, Loader=Yaml11Loader)  # noqa: S506 - a SafeLoader subclass


def test_the_one_dumper_quotes_every_yaml_1_1_look_alike():
    doc = {"words": WORDS, **{w: w for w in WORDS}}
    assert read11(yamlsafe.dump(doc)) == doc
    assert yamlsafe.dump({"a": True, "b": 3}) == "a: true\nb: 3\n"  # values that are not strings stay as they are


def test_a_runs_config_yaml_reads_back_as_written(tmp_path):
    """trainer/run/config.py dump_config: the run directory's config.yaml (and the trackers' copy)."""
    from tests.trainer.tiny_config import tiny_config
    from trainer.run.config import config_to_dict, dump_config, parse_config

    cfg = parse_config(tiny_config(""))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, drafter_init="y", mask_token_id=None))
    assert read11(dump_config(cfg)) == config_to_dict(cfg)


def test_a_playbooks_set_writes_the_config_it_was_given(tmp_path: Path):
    """dflash_ops/playbook/run_steps.py with_settings: a playbook's `set:` on a trainer config."""
    from dflash_ops.playbook.run_steps import with_settings

    config = tmp_path / "train.yaml"
    config.write_text("model:\n  target: {path: /models/q}\nrun: {name: x}\n")
    written = read11(with_settings(config, {"run.name": "n", "model.target.path": "on", "data.tag": "Y"}).decode())
    assert written == {"model": {"target": {"path": "on"}}, "run": {"name": "n"}, "data": {"tag": "Y"}}


@pytest.mark.parametrize("name", ["y", "N", "on", "no"])
def test_the_inventory_writer_quotes_a_target_or_node_named_like_a_boolean(tmp_path: Path, name):
    """dflash_ops/provision/inventory_file.py (provision --write-inventory)."""
    from dflash_ops.provision.inventory_file import with_target

    text = with_target("nodes:\n  pve1: {address: 10.0.0.2}\ntargets: {}\n", tmp_path / "inv.yaml", name, name, 200,
                       base_dir=name)
    assert text is not None
    assert read11(text)["targets"] == {name: {"node": name, "ctid": 200, "base_dir": name}}
