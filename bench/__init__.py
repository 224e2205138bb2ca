"""Benchmarks: run from the repository root as `python -m bench.<name>` (the file names shadow packages)."""
