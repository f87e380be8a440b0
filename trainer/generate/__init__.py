"""Decoding with the target: greedy and speculative decoding, and the acceptance report (τ)."""
