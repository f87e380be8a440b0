"""Complete, crash-safe checkpoints: checkpoints/.tmp-step_N-<pid>/ -> fsync -> checkpoints/step_N/.

A checkpoint holds the drafter (fp32 master weights, safetensors), the optimizer moments and
scheduler (torch.save), the trainer state (step, data position, RNG states) and
manifest.json {"step", "files": {name: {"size", "sha256"}}} written last.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainer.run.contract import (
    fsync_dir,
    fsync_file,
    named_for,
    process_start_ticks,
    sha256_file,
    write_file_synced,
)

MODEL_FILE = "drafter.safetensors"
DRAFTER_CONFIG_FILE = "drafter_config.json"
OPTIM_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"
BEST = "best.json"  # checkpoints/best.json: {"step", "tau"} of the kept best checkpoint (run.keep_best)


class CheckpointError(RuntimeError):
    pass


_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors' Rust writer quotes the errno
IN_PROGRESS = re.compile(r"^\.(?:tmp|trash)-step_\d+-(?P<pid>\d+)$")  # what save and _discard name theirs
NEARLY_FULL = 16 * 2**20  # bytes free below which a failed write is taken for a full disk


def writer_gone(pid: int, path: Path) -> bool:
    """Whether the process `pid` that named `path` after itself is no longer writing it: it is this
    process (which has not begun), gone, or a later process that reuses its pid."""
    if pid == os.getpid():
        return True
    ticks = process_start_ticks(pid)
    if ticks is None:
        return True
    try:  # a live pid of a process started after the directory was last written: the pid was reused
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK") > path.stat().st_mtime + 1
    except (OSError, StopIteration, ValueError):
        return False


def disk_error(exc: BaseException, where: Path) -> OSError | None:
    """The OSError that a failed write under `where` stands for, whatever library wraps it (None:
    not a disk problem). safetensors raises SafetensorError("... No space left on device (os error
    28)"), torch.save RuntimeError("[enforce fail at inline_container.cc] unexpected pos ...") with no
    errno at all: those are read by their errno, or by the space left on the file system."""
    seen: BaseException | None = exc
    for _ in range(8):  # the exception and what caused it
        if seen is None:
            break
        if isinstance(seen, OSError):
            return seen
        found = _OS_ERROR.search(str(seen))
        if found:
            code = int(found[1])
            return OSError(code, f"{os.strerror(code)}: {where} ({type(exc).__name__}: {exc})")
        seen = seen.__cause__ or seen.__context__
    try:
        free = shutil.disk_usage(where if where.exists() else where.parent).free
    except OSError:
        return None
    if free < NEARLY_FULL:
        return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free} bytes free): {where} "
                                     f"({type(exc).__name__}: {exc})")
    return None


def _write_torch(path: Path, obj: object) -> None:
    """torch.save to a path (its C++ writer, not an in-memory copy of gigabytes under the GIL)."""
    torch.save(obj, str(path))
    fsync_file(path)


def rng_state() -> dict:
    state: dict[str, object] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep: int):
        self.dir = Path(run_dir) / "checkpoints"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.best: dict | None = self._read_best()  # never pruned while it is the best

    def remove_stale(self) -> list[str]:
        """Remove the in-progress directories of writers that are gone (a kill or a crash during a
        save leaves `.tmp-step_N-PID`, a whole checkpoint's size): only names this class gives, and
        only when PID is this process (which has not begun a save) or is no longer the process that
        wrote there. Returns the names removed."""
        removed = []
        for p in sorted(self.dir.iterdir()):
            found = IN_PROGRESS.match(p.name)
            if found is None or not p.is_dir() or p.is_symlink():
                continue
            if not writer_gone(int(found["pid"]), p):
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
        return removed

    def _read_best(self) -> dict | None:
        try:
            best = json.loads((self.dir / BEST).read_text())
            return best if (self.path(int(best["step"])) / MANIFEST).exists() else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def mark_best(self, step: int, tau: float) -> None:
        """step_N (complete) is the best so far: best.json names it and pruning keeps it beside the
        latest `keep`; the previous best goes when it is not one of those."""
        previous = self.best
        self.best = {"step": step, "tau": tau}
        write_file_synced(self.dir / ".best.json.tmp", json.dumps(self.best).encode())
        os.replace(self.dir / ".best.json.tmp", self.dir / BEST)
        if previous is not None and previous["step"] != step:
            self.prune()

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints (names starting with '.' are in progress: ignored)."""
        return steps_in(self.dir)

    def restorable_steps(self) -> list[int]:
        """Steps of the complete checkpoints whose files are all there at the sizes their manifest
        names (looks_complete): a half-written or truncated one is never resumed from."""
        return [s for s in self.steps() if looks_complete(self.path(s))]

    def path(self, step: int) -> Path:
        return self.dir / f"step_{step}"

    def save(self, step: int, model: dict[str, torch.Tensor], drafter_config: dict, optim: dict,
             trainer_state: dict) -> tuple[Path, float]:
        """Write step_N completely, then prune old ones. Returns (path, seconds).

        model: the drafter's weights (CPU tensors); optim: {"optimizer": ..., "scheduler": ...}
        state dicts. trainer.train.checkpointer stages them in host memory and calls this from its
        writer thread: the large writes below (safetensors, torch.save to a path, sha256, fsync)
        run without the GIL, so the training thread keeps launching work meanwhile."""
        began = time.time()
        final = self.path(step)
        tmp = self.dir / f".tmp-step_{step}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            self._fill(tmp, step, model, drafter_config, optim, trainer_state)
        except Exception as exc:
            # A full disk: free what this attempt wrote, and say so as an OSError whatever the
            # library raised (a periodic checkpoint is then retried at the next). A kill leaves it,
            # like SIGKILL would; the next start removes it (remove_stale).
            disk = disk_error(exc, final)  # before the space is freed; named as the user knows it
            shutil.rmtree(tmp, ignore_errors=True)
            shown = named_for(disk if disk is not None else exc, tmp, final)
            if shown is not exc:
                raise shown from exc
            raise
        if final.exists():
            self._discard(final)
        os.rename(tmp, final)
        fsync_dir(self.dir)
        self.prune()
        return final, time.time() - began

    def _fill(self, tmp: Path, step: int, model: dict[str, torch.Tensor], drafter_config: dict, optim: dict,
              trainer_state: dict) -> None:
        save_file({k: v.contiguous() for k, v in model.items()}, str(tmp / MODEL_FILE))
        fsync_file(tmp / MODEL_FILE)
        write_file_synced(tmp / DRAFTER_CONFIG_FILE, json.dumps(drafter_config, indent=1).encode())
        _write_torch(tmp / OPTIM_FILE, optim)
        _write_torch(tmp / STATE_FILE, {**trainer_state, "step": step})
        files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(tmp.iterdir())}
        write_file_synced(tmp / MANIFEST, json.dumps({"step": step, "files": files}, indent=1).encode())
        fsync_dir(tmp)

    def _discard(self, path: Path) -> None:
        trash = self.dir / f".trash-{path.name}-{os.getpid()}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def prune(self) -> None:
        best = self.best["step"] if self.best is not None else None
        for step in self.steps()[: -self.keep]:
            if step != best:
                self._discard(self.path(step))

    def resolve(self, which: str) -> Path | None:
        """'latest' or a step number -> a complete checkpoint directory; 'auto': the latest, or None
        (start fresh) when there is none (a supervisor's restart before the first checkpoint)."""
        steps = self.restorable_steps()
        if which == "auto" and not steps:
            return None
        if which in ("latest", "auto"):
            if not steps:
                raise CheckpointError(f"no complete checkpoint in {self.dir}")
            return self.path(steps[-1])
        try:
            step = int(which)
        except ValueError:
            raise CheckpointError(f"--resume takes 'latest', 'auto' or a step number, got {which!r}") from None
        if step not in steps:
            raise CheckpointError(f"no complete checkpoint step_{step} in {self.dir} (have: {steps})")
        return self.path(step)


def steps_in(checkpoints_dir: Path) -> list[int]:
    """Steps of the complete checkpoints (step_N with its manifest.json) in a checkpoints/ directory,
    oldest first; [] when it does not exist."""
    found = []
    for p in checkpoints_dir.iterdir() if checkpoints_dir.is_dir() else ():
        if p.name.startswith("step_") and (p / MANIFEST).exists():
            try:
                found.append(int(p.name[len("step_"):]))
            except ValueError:
                continue
    return sorted(found)


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """A run directory's complete checkpoints, oldest first, for a reader (an evaluation, the lab):
    nothing is created or pruned, as CheckpointManager, the writer's view, does."""
    directory = Path(run_dir) / "checkpoints"
    return [directory / f"step_{step}" for step in steps_in(directory)]


def step_of(path: str | Path) -> int:
    """The step of a checkpoint directory (its name is step_N)."""
    name = Path(path).name
    if not name.startswith("step_") or not name[len("step_"):].isdigit():
        raise CheckpointError(f"{path}: not a checkpoint directory (step_N)")
    return int(name[len("step_"):])


def looks_complete(path: Path) -> bool:
    """manifest.json is readable and every file it lists is there with its size (the cheap check;
    load() verifies the sha256 of what it reads)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        return all((path / name).stat().st_size == meta["size"] for name, meta in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def verify(path: Path, only: tuple[str, ...] | None = None) -> dict:
    """Check every file (or those named in `only`) against manifest.json; returns the manifest."""
    manifest = json.loads((path / MANIFEST).read_text())
    for name, meta in manifest["files"].items():
        if only is not None and name not in only:
            continue
        f = path / name
        if not f.exists() or f.stat().st_size != meta["size"] or sha256_file(f) != meta["sha256"]:
            raise CheckpointError(f"{f}: does not match manifest.json")
    return manifest


def load_weights(path: str | Path) -> dict:
    """The drafter's weights and config only (what an export needs): the optimizer and trainer
    state files are neither verified nor read."""
    path = Path(path)
    manifest = verify(path, only=(MODEL_FILE, DRAFTER_CONFIG_FILE))
    missing = [f for f in (MODEL_FILE, DRAFTER_CONFIG_FILE) if f not in manifest["files"]]
    if missing:
        raise CheckpointError(f"{path}: manifest.json does not list {', '.join(missing)}")
    return {"model": load_file(str(path / MODEL_FILE), device="cpu"),
            "drafter_config": json.loads((path / DRAFTER_CONFIG_FILE).read_text())}


def load(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    """Everything in a checkpoint: model weights, drafter config, optimizer+scheduler, trainer state."""
    path = Path(path)
    verify(path)
    return {
        "model": load_file(str(path / MODEL_FILE), device=str(map_location)),
        "drafter_config": json.loads((path / DRAFTER_CONFIG_FILE).read_text()),
        "optim": torch.load(path / OPTIM_FILE, map_location=map_location, weights_only=True),
        "state": torch.load(path / STATE_FILE, map_location="cpu", weights_only=True),
    }
