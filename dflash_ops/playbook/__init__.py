"""Playbooks: YAML steps validated whole (play), the step registry and its step types."""
