"""Benchmarks: each module runs as `python -m bench.NAME` from the repository root and prints
`RESULT name=value` lines; what they share is in harness/bench.py."""
