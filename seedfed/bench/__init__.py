"""The benchmarks: each a module with `main(argv) -> int`, run as `seedfed bench NAME ...` or
`python -m seedfed.bench.NAME ...` (`registry` lists them), writing JSON and printing a table.

They live in the installed package so that the `seedfed` console script and the worker
subprocesses a benchmark starts (`python -m seedfed.bench.core_worker`, ...) find them from any
install. Their committed results are in the repository's benchmarks/results/.
"""
