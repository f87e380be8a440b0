"""Print numbered source lines of a module as the container's python finds it.

usage: inspect_source.py MODULE [--lines A:B]

The module is located with importlib's finders, one package level at a time, so nothing is
imported (inspecting torch._dynamo.eval_frame does not import torch).
Exit status: 0 ok, 2 bad arguments, 3 module not found or has no source file.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import sys


def find_source(dotted: str) -> str | bool | None:
    parts = dotted.split(".")
    spec = importlib.util.find_spec(parts[0])
    for i in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return None
        name = ".".join(parts[: i + 1])
        spec = importlib.machinery.PathFinder.find_spec(name, list(spec.submodule_search_locations))
    if spec is None:
        return None
    origin = spec.origin
    if origin and origin.endswith(".py"):
        return origin
    return False


def parse_lines(text: str) -> tuple[int, int | None] | None:
    first, sep, last = text.partition(":")
    try:
        a = int(first) if first else 1
        b = int(last) if last else None
    except ValueError:
        return None
    if not sep:
        b = a
    if a < 1 or (b is not None and b < a):
        return None
    return a, b


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="inspect-source")
    parser.add_argument("module")
    parser.add_argument("--lines", default="1:")
    args = parser.parse_args(argv)
    span = parse_lines(args.lines)
    if span is None:
        sys.stderr.write(f"inspect-source: bad --lines {args.lines!r}: expected A:B with 1 <= A <= B\n")
        return 2
    try:
        path = find_source(args.module)
    except (ImportError, ValueError) as e:
        path = None
        sys.stderr.write(f"inspect-source: {e}\n")
    if path is None:
        sys.stderr.write(f"inspect-source: no module named {args.module!r} for {sys.executable}\n")
        return 3
    if path is False:
        sys.stderr.write(f"inspect-source: module {args.module!r} has no Python source file\n")
        return 3
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    first, last = span
    if first > len(lines):
        sys.stderr.write(f"inspect-source: {path} has {len(lines)} lines; --lines starts at {first}\n")
        return 2
    last = len(lines) if last is None else min(last, len(lines))
    width = len(str(last))
    sys.stdout.write(f"# {path}\n")
    for number in range(first, last + 1):
        sys.stdout.write(f"{number:>{width}}  {lines[number - 1]}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
