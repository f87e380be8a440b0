"""dflash-ops: the operator's side. Builds every remote command from an argv (see render.py)."""

__version__ = "0.1.0"
