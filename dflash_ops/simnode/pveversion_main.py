"""`pveversion` on the simulated node: `python -I -S pveversion_main.py --state-root DIR`.

Prints ROOT/node/pveversion (dflash_ops/simnode/gpus.py writes it), else a PVE 8.2 line, as
pve-manager's `pveversion` prints its first line: `pve-manager/8.2.4/faa83925c9641325 (running kernel: ...)`.
"""

import os
import sys

args = sys.argv[1:]
root = os.environ.get("DFLASH_OPS_SIM_ROOT", "~/.local/state/dflash-ops/sim")
if args[:1] == ["--state-root"] and len(args) >= 2:
    root = args[1]
try:
    with open(os.path.join(os.path.expanduser(root), "node", "pveversion")) as f:
        sys.stdout.write(f.read())
except OSError:
    sys.stdout.write("pve-manager/8.2.4/faa83925c9641325 (running kernel: 6.8.12-1-pve)\n")
