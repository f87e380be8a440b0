"""This machine's processes as the tests look at them, through /proc (the containers are local)."""

from __future__ import annotations

from pathlib import Path


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), None once the pid is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """The pid exists and is no zombie (a zombie is gone, just not reaped)."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"


def start_ticks(pid: int) -> int:
    """The process' start time (field 22, clock ticks since boot): with the pid, its identity."""
    fields = proc_stat(pid)
    assert fields is not None, f"pid {pid} is gone"
    return int(fields[19])


def session_members(sid: int) -> list[int]:
    """The live processes of session `sid`."""
    members = []
    for entry in Path("/proc").iterdir():
        fields = proc_stat(entry.name) if entry.name.isdigit() else None
        if fields is not None and fields[0] != "Z" and int(fields[3]) == sid:
            members.append(int(entry.name))
    return members
