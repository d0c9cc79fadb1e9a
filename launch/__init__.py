"""The launcher: the `xds-mpi` command line (cli/), the MPI job it starts and each rank's entry
point (job/), Slurm (slurm/), benchmarks (bench/), serving (serve/), projections (project/), model
tools (model/) and what it prints or writes for a reader (report/)."""
