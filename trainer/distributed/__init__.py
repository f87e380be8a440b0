"""Runs across hosts: the process group, the torchrun launcher, the multi-host trainer and its
gradient sync."""
