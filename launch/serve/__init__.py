"""Serving from the launcher's side: `xds-mpi serve` (command.py), `xds-mpi bench serve` and
`bench endpoint` (bench.py, bench_endpoint.py), and what they read from a served run (stats.py)."""
