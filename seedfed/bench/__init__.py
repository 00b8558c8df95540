"""Side-by-side benchmarks that write JSON and print a table (`seedfed bench ...`).

The measuring code lives in this installed package, not only in the repository's benchmarks/
folder, so that the `seedfed` console script and the per-measurement worker subprocesses
(`python -m seedfed.bench.core_worker`) find it from any install; benchmarks/*.py are thin
scripts over it.
"""
