"""Build one venv per requirements lock inside a container (stdlib only).

  ensure BASE LOCK_HASH [--system-site-packages] [--uv auto|always|never] [--index|--no-index]
      stdin: a tar holding `requirements.txt` and, for hosts without internet, `wheels/*`.
      Reuses BASE/venvs/LOCK_HASH when it is complete. Otherwise builds the venv in
      a scratch dir BASE/venvs/.tmp-venv-PID-TICKS-RAND/venv, installs the requirements (skipping pip entirely when the
      system packages already satisfy every one), checks the venv's python can import them,
      writes .dflash-venv.json and renames it into place. A failed install leaves nothing.

  satisfied REQUIREMENTS_FILE
      Run by the venv's own python: exit 0 when every requirement is installed (no network).

Why the rename is safe: `python -m venv` makes bin/python a symlink to the base interpreter and
pyvenv.cfg names that interpreter's directory, so the venv's python works from any path. Only
the generated bin/ scripts (activate, pip, ...) carry the build path; ops never calls them and
always runs `<venv>/bin/python -m pip`.

When the container's python is itself a venv (a conda-style or venv python in the container,
and the simulated node's), `--system-site-packages` would expose the *base* interpreter's
packages instead of the ones that python sees: the new venv gets a .pth file with the parent
venv's site-packages directories, and `--system-site-packages` only when the parent itself
sees its base's (include-system-site-packages = true). So the venv sees exactly what the
container's python sees, never more.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tarfile
import time

if not __package__:  # run as a script: its directory becomes its package (as_package.py)
    import as_package

    as_package.enter(globals())
from . import nodefacts, venvs

VENV_META = venvs.META
PARENT_PTH = "_dflash_parent_site.pth"
_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")
_SPEC = re.compile(r"^\s*(==|>=|<=|!=|~=|>|<)\s*([0-9][0-9A-Za-z.*+!-]*)\s*$")


def parse_requirements(text: str) -> list[str]:
    """The requirement lines of a requirements file, comments and blank lines dropped."""
    lines = (raw.split("#", 1)[0].strip() for raw in text.splitlines())
    return [line for line in lines if line]


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+", 1)[0].split("."):
        digits = re.match(r"\d+", piece)
        if not digits:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def _spec_holds(installed: str, op: str, wanted: str) -> bool:
    if wanted.endswith(".*") and op in ("==", "!="):
        prefix = _version_tuple(wanted[:-2])
        same = _version_tuple(installed)[: len(prefix)] == prefix
        return same if op == "==" else not same
    have, want = _version_tuple(installed), _version_tuple(wanted)
    width = max(len(have), len(want))
    have, want = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
    if op == "~=":
        upper = _version_tuple(wanted)[:-1]
        return have >= want and have[: len(upper)] == upper
    return {"==": have == want, "!=": have != want, ">=": have >= want, "<=": have <= want,
            ">": have > want, "<": have < want}[op]


def requirement_satisfied(line: str) -> bool:
    """True when `line` (name[extras] spec,spec) is installed at a matching version.

    Anything this small parser does not understand (markers, URLs, options) counts as not
    satisfied, so pip decides.
    """
    from importlib import metadata

    m = _REQ.match(line)
    if not m or ";" in line or "@" in line or line.startswith("-"):
        return False
    name, _extras, specs = m.groups()
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    for spec in filter(None, (s.strip() for s in specs.split(","))):
        sm = _SPEC.match(spec)
        if not sm or not _spec_holds(installed, sm.group(1), sm.group(2)):
            return False
    return True


def parent_site_dirs() -> list[str]:
    """site-packages of the python running this helper when it is itself a venv."""
    if sys.prefix == sys.base_prefix:
        return []
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    dirs += [d for d in site.getsitepackages() if d.startswith(sys.prefix)]
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


def base_site_visible() -> bool:
    """Whether this python sees its base interpreter's site-packages (always, unless a venv)."""
    if sys.prefix == sys.base_prefix:
        return True
    try:
        base_dirs = site.getsitepackages([sys.base_prefix])
    except TypeError:  # very old site.py without the prefixes argument
        return False
    return any(d in sys.path for d in base_dirs)


def find_uv(mode: str) -> str | None:
    if mode == "never":
        return None
    uv = shutil.which("uv", path=os.environ.get("PATH", "") + ":/usr/local/bin:/root/.local/bin")
    if mode == "always" and uv is None:
        raise SystemExit("venv: uv: always, but no uv found in the container")
    return uv


def run(argv: list[str]) -> None:
    proc = subprocess.run(argv, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"venv: command failed with exit {proc.returncode}: {argv}")


class NoPip(Exception):
    """The venv needs pip and the container's python cannot provide it (Debian without python3-venv)."""


NO_PIP_EXIT = 3
NO_PIP_FIX_ARGV = venvs.NO_PIP_FIX_ARGV
NO_PIP_FIX = " ".join(NO_PIP_FIX_ARGV)


def has_module(python: str, name: str) -> bool:
    code = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 1)"
    return subprocess.run([python, "-c", code, name], stdout=subprocess.DEVNULL).returncode == 0


def bootstrap_pip(venv_python: str, wheels: str) -> None:
    """Make `venv_python -m pip` work: it already does (pip visible through the system site), or
    ensurepip installs it (Debian: only with python3-venv), or the operator pushed a pip wheel
    in the venv's wheelhouse (pip runs from its own wheel to install itself). Else NoPip."""
    if has_module(venv_python, "pip"):
        return
    if has_module(venv_python, "ensurepip"):
        run([venv_python, "-m", "ensurepip", "--default-pip"])
        return
    pip_wheels = sorted(f for f in (os.listdir(wheels) if os.path.isdir(wheels) else [])
                        if f.startswith("pip-") and f.endswith(".whl"))
    if pip_wheels:
        wheel = os.path.join(wheels, pip_wheels[-1])
        run([venv_python, os.path.join(wheel, "pip"), "install", "--no-index", "-q", "--disable-pip-version-check", wheel])
        return
    raise NoPip("the container's python has neither ensurepip nor pip, and the requirements are not all installed "
                "(a fresh Debian CT lacks python3-venv); fix: %s in the container, or put a pip wheel in the "
                "venv's wheelhouse" % NO_PIP_FIX)


def venv_site_packages(venv_python: str) -> str:
    out = subprocess.run([venv_python, os.path.abspath(__file__), "purelib"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def check_satisfied(venv_python: str, requirements: str) -> bool:
    return subprocess.run([venv_python, os.path.abspath(__file__), "satisfied", requirements],
                          stdout=subprocess.DEVNULL).returncode == 0


def build(base: str, lock: str, args: argparse.Namespace, stream: nodefacts.BinaryIO) -> dict:
    rel = venvs.rel_path(lock)
    parent = os.path.join(base, venvs.VENVS_DIR)
    os.makedirs(parent, exist_ok=True)
    final = os.path.join(base, rel)
    if venvs.is_complete(base, rel):
        return {"venv": rel, "built": False, "pip": False}
    clean_stale(parent)
    started = time.time()
    scratch = make_scratch_dir(parent, "venv")
    tmp = os.path.join(scratch, "venv")
    stage = os.path.join(scratch, "input")
    try:
        os.makedirs(stage)
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                if not member.isfile() or member.name.startswith("/") or ".." in member.name.split("/"):
                    raise SystemExit(f"venv tar: refusing entry {member.name!r}")
                tar.extract(member, stage)
        requirements = os.path.join(stage, "requirements.txt")
        uv = find_uv(args.uv)
        system_site = args.system_site_packages and base_site_visible()
        if uv:
            cmd = [uv, "venv", "--python", sys.executable, tmp]
        else:
            cmd = [sys.executable, "-m", "venv", "--without-pip", tmp]
        run(cmd + ["--system-site-packages"] if system_site else cmd)
        venv_python = os.path.join(tmp, "bin", "python")
        if args.system_site_packages:
            parents = parent_site_dirs()
            if parents:
                with open(os.path.join(venv_site_packages(venv_python), PARENT_PTH), "w") as f:
                    f.write("".join(d + "\n" for d in parents))
        used_pip = not check_satisfied(venv_python, requirements)
        if used_pip:
            install = ["-r", requirements]
            wheels = os.path.join(stage, "wheels")
            if os.path.isdir(wheels):
                install = ["--no-index", "--find-links", wheels] + install
            elif not args.index:
                install = ["--no-index"] + install
            if uv:
                run([uv, "pip", "install", "--python", venv_python] + install)
            else:
                bootstrap_pip(venv_python, os.path.join(stage, "wheels"))
                run([venv_python, "-m", "pip", "install", "--disable-pip-version-check", "-q"] + install)
            if not check_satisfied(venv_python, requirements):
                raise SystemExit("venv: requirements still unsatisfied after install")
        with open(requirements) as f:
            meta = venvs.make_meta(lock, pip=used_pip, uv=bool(uv), requirements=parse_requirements(f.read()))
        with open(os.path.join(tmp, VENV_META), "w") as f:
            json.dump(meta, f, indent=1)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # a full disk or a failed install: nothing left
    if not check_satisfied(os.path.join(final, "bin", "python"), "-"):
        # Renamed aside first: a kill during the delete must not leave a venv that looks complete.
        aside = make_scratch_dir(parent, "venv")
        os.rename(final, os.path.join(aside, "venv"))
        shutil.rmtree(aside, ignore_errors=True)
        raise SystemExit("venv: python does not start after the rename")
    return {"venv": rel, "built": True, "pip": used_pip,
            "seconds": round(time.time() - started, 3)}


make_scratch_dir = nodefacts.make_scratch_dir


def clean_stale(parent: str) -> None:
    """Remove scratch dirs of dead builds that prove they are ours; nothing else."""
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if nodefacts.stale_scratch_kind(parent, name, ("venv",)) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="venv.py")
    sub = parser.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("ensure")
    e.add_argument("base")
    e.add_argument("lock")
    e.add_argument("--system-site-packages", action="store_true")
    e.add_argument("--uv", choices=["auto", "always", "never"], default="auto")
    e.add_argument("--no-index", dest="index", action="store_false")
    s = sub.add_parser("satisfied")
    s.add_argument("requirements", help="a requirements file, or '-' to only check python starts")
    sub.add_parser("purelib", help="print this python's site-packages directory")
    args = parser.parse_args(argv)
    if args.cmd == "purelib":
        print(sysconfig.get_paths()["purelib"])
        return 0
    if args.cmd == "satisfied":
        if args.requirements == "-":
            return 0
        with open(args.requirements) as f:
            return 0 if all(requirement_satisfied(r) for r in parse_requirements(f.read())) else 1
    try:
        print(json.dumps(build(args.base, args.lock, args, sys.stdin.buffer)))
    except NoPip as e:
        print(json.dumps({"error": str(e), "no_pip": True, "fix": NO_PIP_FIX, "fix_argv": NO_PIP_FIX_ARGV}))
        return NO_PIP_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
