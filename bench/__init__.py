"""aotx's benchmarks.  Each script runs as a module from the repository root, with this
checkout's virtual environment (``.venv/bin/python -m bench.bench_serve``), and starts
what it measures through :mod:`bench.common`."""
