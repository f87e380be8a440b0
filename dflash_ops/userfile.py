"""Editing a file the user owns (the inventory): in place, under a lock, after a re-read.

A file the tool owns (a sidecar, a status file) is replaced: written to a temporary file and
renamed over. A file the user owns must not be: a rename makes a new inode with the writer's
umask and owner (a 0600 inventory holding a webhook token would become 0644 and root's), turns a
symlink into a copy, ignores that the user made the file read-only, and two writers that each
read, changed and renamed lose one another's change. So an edit here:

* follows symlinks and writes the file they point to (the link stays a link);
* refuses a file without write permission, root included (a read-only file says "leave it");
* opens it for update without truncating, takes flock(2) on it (two edits run one after the
  other; the lock is on the inode, which an in-place write keeps), reads it again under the
  lock, and computes the new text from what it holds now, not from an earlier read;
* checks the new text (`check`, which raises with the user's file named) before a byte is written;
* writes the whole new text in one write, truncates, fsyncs. Mode, owner, ACLs and hard links stay.

The price of not renaming: a crash in the middle of the one write can leave the file short. The
new text is built and checked before the write starts, so only the write itself is exposed.
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Callable
from pathlib import Path

from dflash_ops.errors import DflashOpsError

Edit = Callable[[str], "str | None"]  # the file's text now -> its new text (None: nothing to change)
Check = Callable[[str], None]  # raises when the new text must not be written


class UserFileError(DflashOpsError):
    """The user's file cannot be edited: one line naming it and why."""


def edit_in_place(path: Path, edit: Edit, check: Check = lambda text: None,
                  error: type[DflashOpsError] = UserFileError) -> bool:
    """Apply `edit` to the file at `path` in place (module docstring); True when it changed."""
    real = Path(os.path.realpath(path))
    try:
        st = os.stat(real)
    except OSError as e:
        raise error(f"{path}: cannot edit: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: cannot edit: not a regular file")
    if not st.st_mode & 0o222 or not os.access(real, os.W_OK):
        raise error(f"{path}: read-only (mode {stat.S_IMODE(st.st_mode):04o}): not written; "
                    f"make it writable (chmod u+w {path}) or pass another file with --inventory")
    try:
        fd = os.open(real, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"{path}: cannot edit: {e.strerror or e}") from None
    with os.fdopen(fd, "r+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released when the file is closed
        raw = f.read()
        try:
            old = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{path}: cannot edit: not UTF-8 text ({e.reason} at byte {e.start})") from None
        new = edit(old)
        if new is None or new == old:
            return False
        check(new)
        data = new.encode("utf-8")
        f.seek(0)
        f.write(data)
        f.truncate(len(data))
        f.flush()
        os.fsync(f.fileno())
    return True
