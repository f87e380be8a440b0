"""Deploy: the local release (manifest, tar), the venv spec, and pushing both to targets."""
