"""The `xds-mpi` command line, the mpiexec line it builds, and the per-rank entry point."""
