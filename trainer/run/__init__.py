"""The ground floor every role of the trainer stands on (config, the run directory and its contract)."""
