"""The lab: benchmarks that print figures (bench/RESULTS.md), run as scripts (`PYTHONPATH=. python bench/X.py`)
over the product's public API; their shared parts are importable as bench.X for their tests."""
