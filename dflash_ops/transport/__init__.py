"""How bytes reach a node: `SSHTransport` (Fabric/Paramiko) or `LocalTransport` (/bin/sh -c)."""

from dflash_ops.transport.base import LineSplitter, Result, Transport

__all__ = ["LineSplitter", "Result", "Transport"]
