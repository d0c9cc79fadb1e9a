"""`xds-mpi submit`: a Slurm job script rendered from hpc/xds-mpi.sbatch.in (jobscript.py) and
submitted (submit.py)."""
