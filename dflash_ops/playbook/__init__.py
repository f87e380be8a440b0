"""Playbooks: YAML steps validated whole before any runs (play.py), the step-type registry
(registry.py) and the step types registered in it (steps.py, run_steps.py, transfer_steps.py)."""

from dflash_ops.playbook import run_steps, steps, transfer_steps  # noqa: F401  (importing them registers their step types)
