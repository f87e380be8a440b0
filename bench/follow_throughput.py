"""How fast does the `runs follow` helper stream a log? Prints lines/s against `cat` in the same run.

  PYTHONPATH=. python bench/follow_throughput.py [LINES]

Three figures: the helper writing to a pipe (raw), `cat` of the same file (the baseline), and
the helper through follow_file's line splitting and offset tracking on the local side.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

HELPER = Path(__file__).resolve().parents[1] / "dflash_ops" / "helpers" / "runs.py"


def timed(argv: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, check=True).stdout
    return time.perf_counter() - start, out.count(b"\n")


def through_follow_file(path: Path) -> tuple[float, int]:
    """The local side's line handling, fed by the real helper over a pipe."""
    sys.path.insert(0, str(HELPER.parents[2]))
    from dflash_ops.runs.follow import LineStream

    count = 0

    def on_line(line: bytes) -> None:
        nonlocal count
        count += 1

    stream = LineStream(on_line, expected_start=None)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(HELPER), "follow", str(path), "--offset", "0"], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    for line in proc.stdout:
        stream.feed(line)
    proc.wait()
    stream.check(path.name)
    return time.perf_counter() - start, count


def main() -> None:
    lines = int(sys.argv[1]) if len(sys.argv) > 1 else 500_000
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.log"
        with path.open("wb") as f:
            for i in range(lines):
                f.write(b"step %d loss 0.%06d acc 0.5 tokens/s 12345.6 queue 3 gpu 0 busy 97%%\n" % (i, i))
        size_mb = path.stat().st_size / 1e6
        cat_s, cat_lines = timed(["cat", str(path)])
        helper_s, helper_lines = timed([sys.executable, str(HELPER), "follow", str(path), "--offset", "0"])
        local_s, local_lines = through_follow_file(path)
    assert cat_lines == lines and helper_lines == lines + 1 and local_lines == lines
    print(f"{lines} lines, {size_mb:.1f} MB")
    print(f"cat                 {lines / cat_s:12,.0f} lines/s  ({cat_s:.3f} s)")
    print(f"runs.py follow      {lines / helper_s:12,.0f} lines/s  ({helper_s:.3f} s, {helper_s / cat_s:.1f}x cat)")
    print(f"+ local line track  {lines / local_s:12,.0f} lines/s  ({local_s:.3f} s, {local_s / cat_s:.1f}x cat)")


if __name__ == "__main__":
    main()
