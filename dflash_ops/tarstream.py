"""Tar streams sent on a command's stdin: building one from files, its size, counting what is read."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
from pathlib import Path
from typing import IO, Callable, Iterable

SPOOL_BYTES = 64 << 20


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


def _add_file(tar: tarfile.TarFile, name: str, path: Path) -> None:
    st = path.stat()
    info = tarfile.TarInfo(name)
    info.size = st.st_size
    info.mode = 0o755 if st.st_mode & 0o111 else 0o644
    info.mtime = int(st.st_mtime)
    with open(path, "rb") as f:
        tar.addfile(info, f)


def build_tar(entries: Iterable[tuple[str, Path]], extra: Iterable[tuple[str, bytes]] = ()) -> IO[bytes]:
    """One uncompressed tar of (name, file) entries and (name, bytes) extras, in memory (spilling
    to disk past 64 MiB), rewound for reading. Files are stored by content (a symlink's target)."""
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)
    with tarfile.open(fileobj=spool, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in extra:
            _add_bytes(tar, name, data)
        for name, path in entries:
            _add_file(tar, name, path)
    spool.seek(0)
    return spool


def stream_size(stream: IO[bytes]) -> int:
    pos = stream.tell()
    stream.seek(0, os.SEEK_END)
    size = stream.tell()
    stream.seek(pos)
    return size


class ProgressReader:
    """A readable wrapper that reports the size of each chunk handed to the transport."""

    def __init__(self, inner: IO[bytes], on_bytes: Callable[[int], None]):
        self._inner = inner
        self._on_bytes = on_bytes

    def read(self, size: int = -1) -> bytes:
        data = self._inner.read(size)
        if data:
            self._on_bytes(len(data))
        return data
