"""`systemctl` on the simulated node: `python -I -S systemctl_main.py --state-root DIR ARGS`.

Only what provision and doctor ask of a node's systemd, on unit files under ROOT/node/etc/systemd/system
(dflash_ops/simnode/gpus.py `reboot` runs an enabled unit's effect at the simulated boot):
`daemon-reload`; `enable UNIT` (the link in multi-user.target.wants/, systemctl's messages);
`is-enabled UNIT` (`enabled` and 0, `disabled` and 1; a unit without a file: systemctl's message, 1).
"""

import os
import sys

args = sys.argv[1:]
root = "~/.local/state/dflash-ops/sim"
if args[:1] == ["--state-root"] and len(args) >= 2:
    root, args = args[1], args[2:]
units = os.path.join(os.path.expanduser(root), "node", "etc", "systemd", "system")
wants = os.path.join(units, "multi-user.target.wants")


def main() -> int:
    if args == ["daemon-reload"]:
        return 0
    if len(args) == 2 and args[0] in ("enable", "is-enabled"):
        unit = args[1]
        if not os.path.isfile(os.path.join(units, unit)):
            verb = "enable unit" if args[0] == "enable" else "get unit file state for " + unit
            sys.stderr.write(f"Failed to {verb}: Unit file {unit} does not exist.\n"
                             if args[0] == "enable" else f"Failed to {verb}: No such file or directory\n")
            return 1
        link = os.path.join(wants, unit)
        if args[0] == "is-enabled":
            sys.stdout.write("enabled\n" if os.path.islink(link) else "disabled\n")
            return 0 if os.path.islink(link) else 1
        if not os.path.islink(link):
            os.makedirs(wants, exist_ok=True)
            os.symlink(os.path.join("/etc/systemd/system", unit), link)
            sys.stderr.write(f"Created symlink /etc/systemd/system/multi-user.target.wants/{unit} → "
                             f"/etc/systemd/system/{unit}.\n")
        return 0
    sys.stderr.write("systemctl (simulated node): only daemon-reload, enable UNIT, is-enabled UNIT\n")
    return 1


sys.exit(main())
