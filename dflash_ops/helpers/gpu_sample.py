"""Sample per-GPU utilization and memory inside a container; print one JSON object.

Stdlib only (pushed into containers as a versioned helper). NVML through pynvml /
nvidia-ml-py when importable, else `nvidia-smi --query-gpu=...`. Output:

    {"version": 1, "source": "nvml"|"nvidia-smi",
     "gpus": [{"index": 0, "busy": 87.0, "mem_gb": 40.1, "mem_total_gb": 80.0}, ...]}

or, where there is no GPU (the simulated node, a CPU box):

    {"version": 1, "source": null, "gpus": null, "reason": "..."}

Exit status is 0 in both cases: "no GPU" is an answer, not an error.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

VERSION = 1
_GB = 1024**3
_SMI_QUERY = ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used,memory.total",
              "--format=csv,noheader,nounits"]


def _sample_nvml() -> list[dict]:
    import pynvml  # nvidia-ml-py installs this module name

    pynvml.nvmlInit()
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append({"index": index, "busy": float(util.gpu), "mem_gb": round(mem.used / _GB, 2),
                         "mem_total_gb": round(mem.total / _GB, 2)})
        return gpus
    finally:
        pynvml.nvmlShutdown()


def parse_smi_csv(text: str) -> list[dict]:
    """Parse `nvidia-smi --query-gpu=index,utilization.gpu,memory.used,memory.total` (MiB)."""
    gpus = []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 4:
            continue
        index, busy, used, total = fields
        gpus.append({"index": int(index), "busy": _float_or_none(busy), "mem_gb": _mib_to_gb(used),
                     "mem_total_gb": _mib_to_gb(total)})
    return gpus


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]" on some boards
        return None


def _mib_to_gb(text: str) -> float | None:
    value = _float_or_none(text)
    return None if value is None else round(value / 1024, 2)


def _sample_smi() -> list[dict]:
    if shutil.which("nvidia-smi") is None:
        raise LookupError("nvidia-smi not found")
    done = subprocess.run(_SMI_QUERY, capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip() or "nvidia-smi exit %d" % done.returncode)
    return parse_smi_csv(done.stdout)


def sample() -> dict:
    """Return the JSON-ready dict described in the module docstring."""
    reasons = []
    for source, probe in (("nvml", _sample_nvml), ("nvidia-smi", _sample_smi)):
        try:
            gpus = probe()
        except Exception as exc:  # noqa: BLE001 - every probe failure is a reason, not a crash
            reasons.append("%s: %s" % (source, exc))
            continue
        if gpus:
            return {"version": VERSION, "source": source, "gpus": gpus}
        reasons.append("%s: no devices" % source)
    return {"version": VERSION, "source": None, "gpus": None, "reason": "; ".join(reasons)}


def main() -> int:
    json.dump(sample(), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
