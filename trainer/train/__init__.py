"""The training loop and what it holds: config, components, checkpoints, optimizer, control
requests, the run directory."""
