"""How bytes reach a node: `SSHTransport` (Fabric/Paramiko) or `LocalTransport` (/bin/sh -c)."""
