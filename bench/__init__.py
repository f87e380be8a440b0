"""The lab: benchmarks that print figures (bench/RESULTS.md), run as scripts (`PYTHONPATH=. python bench/X.py`)
over the product's public API; their shared parts are importable as bench.X for their tests.

The lab keeps the product's rules (tests/unit/test_bench_rules.py): it reads run directories and
checkpoints only through trainer.run.contract, trainer.run.checkpoint and dflash_ops.runs, imports
no private name, each script's `main` is at most 80 lines over functions that have tests, it is
type-checked with the rest, and the product never names a benchmark script (no hooks for one).
"""
