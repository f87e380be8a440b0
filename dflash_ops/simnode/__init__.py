"""The simulated Proxmox node: a `pct` stand-in whose containers are state files on this machine."""
