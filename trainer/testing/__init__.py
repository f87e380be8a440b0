"""Test helpers shipped with the trainer (like fabric/testing): model directories built locally."""
