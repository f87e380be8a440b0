"""Errors the command line reports as one clean line (no traceback)."""

from __future__ import annotations


class DflashOpsError(Exception):
    """Base of every error dflash-ops expects and reports to the user as one line."""


class UsageError(DflashOpsError, ValueError):
    """A value given to dflash-ops is not valid (an option, a step parameter, a request kind)."""


class InventoryError(DflashOpsError):
    """The inventory file is missing, unreadable or does not match the schema."""


class TransportError(DflashOpsError):
    """Bytes could not reach the node (connect failed, channel broke, ...)."""


class ConnectionLost(TransportError):
    """The connection dropped while a command was running; its outcome is unknown.

    Callers that follow a stream (logs) reconnect by running their next command: the
    transport reconnects transparently when a command starts on a dead connection.
    """


class Unreachable(TransportError):
    """The node could not be reached at all (refused, timed out, reset before login): nothing ran.

    Worth retrying later, unlike a refused host key or failed authentication (plain
    TransportError), which retrying cannot fix.
    """


class CommandTimeout(TransportError):
    """A command ran past its timeout; it was killed (local) or its channel closed (SSH)."""

    def __init__(self, command: str, timeout: float | None):
        super().__init__(f"command timed out after {timeout or 0:g}s: {command[:200]}")
        self.command = command
        self.timeout = timeout


class RemoteCommandError(DflashOpsError):
    """A command ran in the container and exited non-zero (raised when check=True)."""

    def __init__(self, argv: list[str], exit_code: int, stderr: str):
        tail = stderr.strip().splitlines()[-5:]
        detail = (": " + " | ".join(tail)) if tail else ""
        super().__init__(f"{argv!r} exited with status {exit_code}{detail}")
        self.argv = argv
        self.exit_code = exit_code
        self.stderr = stderr


class TransferError(DflashOpsError):
    """A file transfer did not arrive intact (checksum mismatch, pct push/pull failed)."""


class HelperFailed(DflashOpsError):
    """A helper script exited with a status its caller does not accept, or printed no JSON answer.

    `document` is the JSON object it printed (its error document; {} when none); `reason` is
    the document's error, else the end of its stderr.
    """

    def __init__(self, name: str, args: list[str], exit_code: int, stderr: str, stdout: str = "",
                 document: dict | None = None):
        self.helper, self.exit_code, self.stderr, self.document = name, exit_code, stderr, document or {}
        tail = " | ".join(stderr.strip().splitlines()[-5:])
        self.reason: str = str(self.document.get("error") or tail or "no error message")
        command = f"{name.replace('-', '_')}.py {args[0] if args else ''}".strip()
        if exit_code == 0:
            super().__init__(f"{command}: unexpected output {stdout[-200:]!r}")
        else:
            super().__init__(f"{command} failed (exit {exit_code}): {self.reason}")
