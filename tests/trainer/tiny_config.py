"""The tiny trainer config that CPU training tests share: a random 2-layer target, a 1-layer
drafter, synthetic conversations. A test writes only what it changes, as YAML overlays merged
into BASE key by key (a mapping into a mapping, anything else replaces)."""

from __future__ import annotations

import yaml

BASE = """
model:
  target:
    tiny: {layers: 2, hidden: 32, heads: 4, kv_heads: 2, head_dim: 8, intermediate: 64, fit_steps: 0}
  drafter_layers: 1
  block_size: 4
  num_target_layers: 2
  dtype: fp32
  loss_chunk: 256
data:
  synthetic: {n_train: 64, n_eval: 2, seed: 0, min_len: 8, max_len: 30}
  max_length: 64
  num_anchors: 4
  token_budget: 128
  bucket_edges: [32, 64]
  pad_multiple: 16
optim: {lr: 0.003, micro_batches: 2}
run: {log_every: 1, threads: 1}
eval: {samples: 1, max_new_tokens: 4}
"""

# One run across hosts: tests/trainer/test_multihost.py and tests/integration/test_multinode_runs.py.
TWO_HOSTS = """
optim: {total_steps: %(steps)d}
run: {checkpoint_every: 5}
pipeline: {kind: threaded}
distributed: {peer_timeout_s: 5}
"""


def tiny_config(*overlays: str) -> str:
    """BASE with each overlay merged in, in order, as YAML text for parse_config or a file."""
    config = yaml.safe_load(BASE)
    for overlay in overlays:
        _merge(config, yaml.safe_load(overlay) or {})
    return yaml.safe_dump(config, sort_keys=False)


def two_host_config(steps: int, *overlays: str) -> str:
    return tiny_config(TWO_HOSTS % {"steps": steps}, *overlays)


def _merge(into: dict, overlay: dict) -> None:
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
