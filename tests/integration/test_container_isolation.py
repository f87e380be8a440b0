"""A simulated container's python sees what a node's would: the stdlib, the trainer's packages (as an
admin's `apt install python3-torch` gives them) and what deploy put into it, never the operator's own
packages (issue #54 item 4). Were the operator's site-packages visible, a trainer import missing from
trainer/requirements.txt would pass every test here and fail on a real node."""

from __future__ import annotations

import json

import pytest

from dflash_ops.connect import open_container
from dflash_ops.inventory import load_inventory

pytestmark = pytest.mark.lxc_tier

OPERATORS = ("textual", "fabric", "paramiko", "dflash_ops", "pytest", "ruamel.yaml")
TRAINERS = ("torch", "transformers", "safetensors", "yaml", "tokenizers")


def test_the_containers_python_imports_the_trainers_packages_and_none_of_the_operators(sim_inventory):
    container = open_container(load_inventory(sim_inventory), "host200")
    probe = ("import importlib, json, sys\n"
             "found = {}\n"
             "for name in sys.argv[1:]:\n"
             "    try:\n"
             "        importlib.import_module(name)\n"
             "        found[name] = True\n"
             "    except ImportError:\n"
             "        found[name] = False\n"
             "print(json.dumps(found))\n")
    result = container.exec([container.target.python, "-c", probe, *OPERATORS, *TRAINERS], timeout=300)
    assert result.ok, result.stderr
    found = json.loads(result.stdout)
    assert [name for name in OPERATORS if found[name]] == []
    assert [name for name in TRAINERS if not found[name]] == []


def test_a_package_outside_the_requirements_is_not_importable_even_by_path_tricks(sim_inventory):
    """`site.getsitepackages()` and `sys.path` of the container's python name no directory that holds
    the operator's packages (a trainer that appends a site directory finds nothing of ours there)."""
    container = open_container(load_inventory(sim_inventory), "host200")
    code = ("import os, site, sys\n"
            "dirs = [p for p in sys.path + site.getsitepackages() if os.path.isdir(p)]\n"
            "print('\\n'.join(p for p in dirs if os.path.isdir(os.path.join(p, 'textual'))))\n")
    result = container.exec([container.target.python, "-c", code], timeout=120)
    assert result.ok and result.stdout.strip() == "", result.stdout + result.stderr
