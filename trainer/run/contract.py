"""The run directory's contract between the trainer and the helpers (docs/run-directory.md), in code:
its version, the final states, status.json's fields (names and types, once), the metrics.jsonl
event kinds, a process's start time (the one liveness rule: a zombie counts as gone), how a file is
written (atomic replace, fsync) and hashed, and how a reader on the run's machine reads status.json
metrics.jsonl and train.log back.

Stdlib only, python 3.8+: the trainer imports it as trainer.run.contract, and dflash-ops ships this
same file beside its helpers as a shared module (dflash_ops/helpers/__init__.py SHARED_ELSEWHERE),
since the trainer never imports dflash_ops and the helpers run on the container's python. A change
here is a new version of every helper that imports it (its hash covers this file).
"""

from __future__ import annotations

import json
import os

CONTRACT_VERSION = 1

# The run states after which a trainer does no more work.
FINAL_STATES = ("stopped", "failed", "done")
STATES = ("starting", "warmup", "running", "checkpointing") + FINAL_STATES

# status.json's fields, each with the JSON type a reader accepts (an int passes for a float; None
# is always allowed: a field not measured yet, or optional). The trainer writes them
# (trainer/run/rundir.py, metrics.py); dflash_ops' RunInfo and the dashboard's RunRow read the
# same list, so a new field is named here and in whatever draws it.
STATUS_FIELDS = (
    ("version", int),  # CONTRACT_VERSION
    ("run_id", str),  # the directory's name
    ("state", str),  # one of STATES
    ("pid", int),  # the trainer's process id
    ("pid_start", int),  # process_start_ticks(pid): tells a reused pid from the trainer
    ("step", int),  # optimizer steps completed
    ("total_steps", int),
    ("started", float),  # unix time the process started
    ("heartbeat", float),  # unix time of the last update (at least every 10 s while alive)
    ("loss", float),
    ("acc", float),
    ("tau", float),  # pooled mean acceptance length of the last evaluation
    ("tau_per_prompt", float),
    ("tau_lookup", float),  # n-gram prompt lookup's tau on the same prompts
    ("tau_ratio", float),  # tau / tau_lookup
    ("tau_by_length", dict),  # {bucket: {prompts, tau, tau_lookup}} per PROMPT_LENGTH_BUCKETS, buckets with prompts
    ("tau_by_temperature", dict),  # {"0.7": {tau, tau_expected, tau_lookup, tau_lookup_expected}} per eval.temperatures
    ("acceptance", list),  # the last evaluation's share of rounds accepting draft position k, k = 1..block-1
    ("tokens_per_s", float),
    ("tokens_per_s_steady", float),
    ("pad_share", float),
    ("gpus", list),  # GPU indices the run holds
    ("last_checkpoint", str),  # e.g. checkpoints/step_40
    ("last_checkpoint_error", dict),  # {step, message}
    ("recompiles", int),
    ("error", dict),  # {message, traceback, thread} when state is failed
    ("write_failures", dict),  # {status, metrics, log}: writes lost (a full disk)
    ("last_write_error", dict),  # {what, message, time}
    ("distributed", dict),  # a run across hosts (docs/multi-node.md)
    ("phase", dict),  # what the run is doing now: {name, done, total, since} (phase_text)
    ("tokens_done", int),  # real tokens trained so far (this process and the checkpoint it resumed)
    ("tokens_total", int),  # tokens the whole run will train: tokens_done per step x total_steps (an estimate)
    ("tokens_per_s_recent", float),  # real tokens per second over the last logged windows (eta_seconds)
)

# status.json `phase` names, in the order a run meets them: each says what the process is doing
# from its first second, so a long load or fit is never silent (docs/run-directory.md).
PHASES = ("starting", "tokenising", "loading the target", "fitting the target", "building the drafter",
          "compiling and warming up", "training", "evaluating", "checkpointing", "stopping", "finished")


def phase_text(phase: object) -> str:
    """`fitting the target 120/300` from status.json's `phase` (or a `phase` event); empty when absent or
    malformed; control characters replaced, the name cut at 80 characters."""
    if not isinstance(phase, dict) or not isinstance(phase.get("name"), str):
        return ""
    done, total = phase.get("done"), phase.get("total")
    count = ""
    if isinstance(done, int) and not isinstance(done, bool):
        count = " %d/%d" % (done, total) if isinstance(total, int) and not isinstance(total, bool) else " %d" % done
    name = "".join("\ufffd" if ord(c) < 32 or 127 <= ord(c) < 160 else c for c in phase["name"][:80])
    return name + count  # a run directory's text reaches terminals: no control characters, bounded


def eta_seconds(status: dict) -> float | None:
    """Seconds until a live run's last step as of its last logged window: the tokens to go over its
    own recent throughput (tokens_per_s_recent, else the last window's tokens_per_s). None when the
    run is final, not training yet or not measured."""
    done, total = status.get("tokens_done"), status.get("tokens_total")
    rate = status.get("tokens_per_s_recent") or status.get("tokens_per_s")
    if status.get("state") in FINAL_STATES or not isinstance(done, int) or not isinstance(total, int):
        return None
    if not isinstance(rate, (int, float)) or rate <= 0:
        return None
    return max(0.0, (total - done) / rate)


def duration_text(seconds: object) -> str:
    """`45s`, `12m`, `3h05m`, `2d04h`; `-` for None."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return "-"
    s = int(round(seconds))
    if s < 60:
        return "%ds" % s
    if s < 3600:
        return "%dm" % (s // 60)
    if s < 86400:
        return "%dh%02dm" % (s // 3600, s % 3600 // 60)
    return "%dd%02dh" % (s // 86400, s % 86400 // 3600)

# The prompt-length buckets evaluation reports tau in (tokens of the rendered prompt): (name, upper
# bound inclusive; None: no bound). Acceptance collapses on long prompts where a drafter saw short
# ones only: one pooled tau hides where.
PROMPT_LENGTH_BUCKETS = (("<=2K", 2048), ("2-8K", 8192), ("8-32K", 32768), (">32K", None))


def length_bucket(tokens: int) -> str:
    """The PROMPT_LENGTH_BUCKETS name of a prompt of `tokens` tokens."""
    for name, bound in PROMPT_LENGTH_BUCKETS:
        if bound is None or tokens <= bound:
            return name
    raise AssertionError("the last bucket has no bound")


def tau_by_length_text(by_length: object) -> str:
    """`<=2K 3.21 (lookup 1.50, 12 prompts); 2-8K ...` from an evaluation's tau_by_length (the
    trainer's log, `run status`, the dashboard); entries not of the contract's shape are left out."""
    parts = []
    for name, b in (by_length.items() if isinstance(by_length, dict) else ()):
        if not isinstance(b, dict) or not isinstance(b.get("tau"), (int, float)):
            continue
        lookup = b.get("tau_lookup")
        lookup_text = "lookup %.2f, " % lookup if isinstance(lookup, (int, float)) else ""
        n = b.get("prompts", "?")
        parts.append("%s %.2f (%s%s prompt%s)" % (name, b["tau"], lookup_text, n, "" if n == 1 else "s"))
    return "; ".join(parts)


TEMPERATURE_FIELDS = ("tau", "tau_expected", "tau_lookup", "tau_lookup_expected")


def tau_by_temperature(reports: object) -> dict:
    """An evaluation's `temperatures` ({label: report}) cut to status.json's tau_by_temperature:
    {label: {tau, tau_expected, tau_lookup, tau_lookup_expected}}."""
    return {str(label): {k: r.get(k) for k in TEMPERATURE_FIELDS}
            for label, r in (reports.items() if isinstance(reports, dict) else ()) if isinstance(r, dict)}


def tau_by_temperature_text(by_temperature: object) -> str:
    """`T=0 3.21 (expected 3.21, lookup 1.50); T=1 2.40 (expected 2.38, lookup 1.31)` from an eval's
    `temperatures` or status.json's tau_by_temperature (sampled τ, then the expected τ, lookup's
    sampled τ); entries not of the contract's shape are left out."""
    parts = []
    for label, t in (by_temperature.items() if isinstance(by_temperature, dict) else ()):
        if not isinstance(t, dict) or not isinstance(t.get("tau"), (int, float)):
            continue
        extra = ["%s %.2f" % (name, t[key]) for name, key in (("expected", "tau_expected"), ("lookup", "tau_lookup"))
                 if isinstance(t.get(key), (int, float))]
        parts.append("T=%s %.2f" % (label, t["tau"]) + (" (%s)" % ", ".join(extra) if extra else ""))
    return "; ".join(parts)


# metrics.jsonl: every line is {"event": one of these, "time": float, "step": int, ...}
EVENT_KINDS = ("start", "warmup", "step", "eval", "checkpoint", "checkpoint_failed", "stop", "error",
               "restart", "tracker_error", "phase")  # restart: written by the helpers' supervisor


def status_field_names() -> tuple[str, ...]:
    return tuple(name for name, _ in STATUS_FIELDS)


def status_value(name: str, value: object) -> object:
    """`value` when it has the contract's type for status field `name`, else None (a reader's view:
    a wrong type is treated as absent, never trusted)."""
    kind = dict(STATUS_FIELDS).get(name)
    if kind is None or value is None or isinstance(value, bool):
        return None
    if kind is float:
        return value if isinstance(value, (int, float)) else None
    return value if isinstance(value, kind) else None


def status_fields(doc: dict) -> dict:
    """The contract's status fields of a status.json document (or a helper's document holding
    them), each of the right type; the absent and the mistyped ones left out."""
    found = {}
    for name, _ in STATUS_FIELDS:
        value = status_value(name, doc.get(name))
        if value is not None:
            found[name] = value
    return found


# ---------------------------------------------------------------- reading a run directory on its machine

def read_status(run_dir: str | os.PathLike[str]) -> dict | None:
    """A run directory's status.json, or None when it is absent or not a JSON object (the trainer
    replaces it atomically, so a reader never meets half of one)."""
    try:
        with open(os.path.join(run_dir, "status.json"), encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def read_events(run_dir: str | os.PathLike[str]) -> list[dict]:
    """A run directory's metrics.jsonl events in order ([] when it has none yet): every line that is
    a JSON object; a torn last line (the trainer killed mid-write) or a blank one is skipped."""
    events = []
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    events.append(event)
    except FileNotFoundError:
        pass
    return events


def read_log(run_dir: str | os.PathLike[str]) -> str:
    """A run directory's train.log as text ("" when it has none yet; bytes that are not UTF-8 replaced)."""
    try:
        with open(os.path.join(run_dir, "train.log"), encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


# ---------------------------------------------------------------- processes

def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, session id, start time in clock ticks) from /proc/<pid>/stat, or None when the
    pid is gone or unreadable. The command name in parentheses may hold spaces and parentheses."""
    try:
        with open("/proc/%d/stat" % int(pid), "rb") as f:
            text = f.read().decode("ascii", "replace")
    except (OSError, ValueError, TypeError):
        return None
    rest = text[text.rfind(")") + 2:].split()
    try:
        return rest[0], int(rest[3]), int(rest[19])
    except (IndexError, ValueError):
        return None


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (the start time that tells a pid's reuse apart), or None when
    the process is gone, unreadable (off Linux) or a zombie: a zombie does no more work, so every
    liveness check on either side (the helpers, the trainer's launcher) counts it as gone."""
    stat = proc_stat(pid)
    if stat is None or stat[0] == "Z":
        return None
    return stat[2]


# ---------------------------------------------------------------- files

def fsync_file(path: str | os.PathLike[str]) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_synced(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` and fsync it (no rename: see write_atomic)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def named_for(exc: BaseException, tmp: str | os.PathLike[str], dest: str | os.PathLike[str]) -> BaseException:
    """`exc` as the user should read it: an OSError about the temporary copy of an atomic write
    (`.NAME.PID.tmp`, `.tmp-step_N-PID`: a name the user never gave) names the destination instead,
    the same errno kept; anything else is returned as it is (#55 item 8: "No space left on device:
    /out/.model.tmp-14890")."""
    if not isinstance(exc, OSError):
        return exc
    t, d = os.fspath(tmp), os.fspath(dest)

    def swap(value: object) -> object:
        return value.replace(t, d) if isinstance(value, str) else value

    if exc.errno is not None and exc.strerror is not None and exc.filename is None:
        return OSError(exc.errno, exc.strerror, d)  # a write's error names no file: name the destination
    if t not in str(exc):
        return exc
    if exc.errno is None or exc.strerror is None:
        return OSError(swap(str(exc)))
    renamed = OSError(exc.errno, swap(exc.strerror), swap(exc.filename), None, swap(exc.filename2))
    return renamed  # OSError(errno, ...) is the errno's subclass (FileNotFoundError, ...), as the original


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace `path` with `data` in one rename, the bytes on disk first: readers see the old or
    the new file, never half of one. The tmp file (.NAME.PID.tmp beside it: readers ignore names
    starting with '.') is removed when the write fails (a full disk), and the error raised, naming
    `path` (named_for)."""
    head, name = os.path.split(os.fspath(path))
    tmp = os.path.join(head, ".%s.%d.tmp" % (name, os.getpid()))
    try:
        write_file_synced(tmp, data)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        renamed = named_for(e, tmp, path)
        if renamed is e:
            raise
        raise renamed from None


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """The hex sha256 of a file's bytes, read in chunks."""
    import hashlib  # here, not at the top: loading OpenSSL is most of what `runs.py list` would spend on it

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()
