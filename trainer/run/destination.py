"""May a command replace its destination? The one replace rule: the trainer's export applies it
here; the operator's push (in the container) and fetch use this same file, which dflash-ops ships
beside its `tree` helper as a shared module (dflash_ops/helpers/__init__.py), since the trainer never
imports dflash_ops. Stdlib only, python 3.8+ (it runs on the container's python too).
"""

from __future__ import annotations

import json
import os
import stat

FILE_REL = "."


class Refused(Exception):
    """The destination may not be replaced (the message says what would have been lost)."""


def read_json(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):
        return None


def dest_path(dest: str, rel: str) -> str:
    return dest if rel == FILE_REL else os.path.join(dest, rel)


# ---------------------------------------------------------------- may this destination be replaced?
#
# The one rule for every command that replaces a file or directory with its output (push in the
# container, fetch on the operator's side, trainer export):
#   * never a protected path: /, a system directory, the working directory or an ancestor of it,
#     the home directory or an ancestor of it, the target's base_dir or an ancestor of it;
#   * otherwise only when DEST is absent or empty, or provably an earlier output of the same
#     command (its record lists every file DEST holds);
#   * `force` also lets it replace an earlier output of another command (a marker
#     `.NAME.dflash-KIND.json` beside DEST lists every file DEST holds) - never a protected path,
#     never a file no command wrote.
# A refusal says what would have been lost, and suggests no flag that would lose it.

OUTPUT_KINDS = ("push", "fetch", "export", "hub-model")  # hub-model: trainer_tools.fixtures.hub_model
SYSTEM_DIRS = frozenset((
    "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/media", "/mnt", "/opt",
    "/proc", "/root", "/run", "/sbin", "/snap", "/srv", "/sys", "/tmp", "/usr", "/var", "/lost+found"))
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin",
                "/sys", "/usr", "/var/lib", "/var/log", "/var/cache", "/var/spool", "/var/run")


def marker_path(dest: str, kind: str) -> str:
    """Where a command of `kind` records, beside DEST, the files its output at DEST holds."""
    parent, name = os.path.split(dest.rstrip("/") or "/")
    return os.path.join(parent, ".%s.dflash-%s.json" % (name, kind))


def marker_files(doc: dict | None) -> set[str] | None:
    """The entries a marker or record says its command wrote (None: no usable marker)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), (dict, list)):
        return None
    previous = doc.get("previous")
    return set(doc["files"]) | set(previous if isinstance(previous, list) else [])


def protected_paths(base_dir: str | None = None) -> list[tuple[str, str]]:
    """(path, what it is) of the places no command replaces, here: the working directory,
    the home directory, the target's base_dir."""
    found = []
    try:
        found.append((os.getcwd(), "the working directory"))
    except OSError:
        pass
    homes = {os.path.expanduser("~")}
    try:
        import pwd

        homes.add(pwd.getpwuid(os.getuid()).pw_dir)
    except (ImportError, KeyError):
        pass
    found += [(h, "the home directory") for h in sorted(homes) if h and h.startswith("/")]
    if base_dir:
        found.append((base_dir, "the target's base_dir (its releases, venvs and runs)"))
    return found


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def protected_reason(dest: str, protected: list[tuple[str, str]]) -> str | None:
    """Why DEST is on the protected list, or None. Compares the path as given and as resolved."""
    spellings = {os.path.normpath(os.path.abspath(dest)), os.path.realpath(dest)}
    for path in sorted(spellings):
        if path == "/":
            return "the root directory"
        if path in SYSTEM_DIRS or any(_within(path, t) for t in SYSTEM_TREES):
            return "a system directory"
        places = [(spelling, what) for place, what in protected
                  for spelling in sorted({os.path.normpath(place), os.path.realpath(place)})]
        for spelling, what in places:
            if path == spelling:
                return what
        for spelling, what in places:
            if _within(spelling, path):
                return "an ancestor of %s (%s)" % (what, spelling)
    return None


def dest_entries(dest: str) -> tuple[str, list[str]]:
    """(kind, entries) of everything a replace of DEST would remove: ("none", []), ("file", ["."]),
    ("tree", [every file, link and special file, relative]), or ("other", ["."])."""
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return "none", []
    if stat.S_ISREG(st.st_mode):
        return "file", [FILE_REL]
    if not stat.S_ISDIR(st.st_mode):
        return "other", [FILE_REL]
    entries = []
    for dirpath, dirnames, filenames in os.walk(dest):
        dirnames.sort()
        for name in sorted(filenames) + sorted(d for d in dirnames if os.path.islink(os.path.join(dirpath, d))):
            entries.append(os.path.relpath(os.path.join(dirpath, name), dest).replace(os.sep, "/"))
    return "tree", sorted(entries)


def _listing(dest: str, entries: list[str]) -> str:
    """`3 files (a.txt, b/c.bin, ...), 1.2 MB` - what a refusal says would be lost."""
    size = 0
    for rel in entries:
        try:
            size += os.lstat(dest_path(dest, rel)).st_size
        except OSError:
            pass
    if entries == [FILE_REL]:
        return "a file of %s" % size_text(size)
    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    return "%d file%s (%s), %s" % (len(entries), "" if len(entries) == 1 else "s", shown, size_text(size))


def size_text(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return "%.1f %s" % (n / scale, unit)
    return "%d bytes" % n


def _top_listing(path: str) -> str:
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return "what it holds"
    if not names:
        return "nothing yet, but it is never replaced"
    return "%d entr%s: %s" % (len(names), "y" if len(names) == 1 else "ies",
                              ", ".join(names[:6]) + (", ..." if len(names) > 6 else ""))


def refuse_replacing(dest: str, kind: str, force: bool = False) -> None:
    """Raise Refused unless output of `kind` may replace DEST (the rule above), its own record read
    from the marker beside DEST: the check a writer makes before it reads or builds anything."""
    refusal = replace_refusal(dest, kind, own=marker_files(read_json(marker_path(dest, kind))), force=force)
    if refusal:
        raise Refused(refusal)


def replace_refusal(dest: str, command: str, *, own: set[str] | None, force: bool = False,
                    protected: list[tuple[str, str]] | None = None) -> str | None:
    """Why `command` may not replace DEST with its output, or None when it may (the rule above).

    `own`: the entries `command`'s own record says it wrote at DEST (None: no record)."""
    why = protected_reason(dest, protected if protected is not None else protected_paths())
    if why is not None:
        return "refusing to replace %s: it is %s, holding %s" % (dest, why, _top_listing(dest))
    kind, entries = dest_entries(dest)
    if kind == "none" or not entries:
        return None
    if kind == "other":
        return "refusing to replace %s: it is neither a regular file nor a directory" % dest
    if own is not None and set(entries) <= own:
        return None
    others = [(k, marker_files(read_json(marker_path(dest, k)))) for k in OUTPUT_KINDS if k != command]
    other = [k for k, files in others if files is not None and set(entries) <= files]
    if other and force:
        return None
    if other:
        return ("%s holds the output of an earlier %s (%s); --force replaces it with this %s's"
                % (dest, other[0], _listing(dest, entries), command))
    claimed = own or set()
    for _, files in others:
        claimed |= files or set()
    foreign = [e for e in entries if e not in claimed]
    if own is not None or claimed:
        return ("refusing to replace %s: it holds %s that no %s wrote and that would be lost; move %s away "
                "or choose another destination" % (dest, _listing(dest, foreign), command,
                                                   "it" if len(foreign) == 1 else "them"))
    return ("refusing to replace %s: it holds %s that no dflash-ops %s wrote; move %s away or choose "
            "another destination" % (dest, _listing(dest, entries), command, "it" if len(entries) == 1 else "them"))
