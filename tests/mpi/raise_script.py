"""One rank raises while every other rank waits for it in MPI (run with `python -m mpi4py`)."""

import sys

from mpi4py import MPI

comm = MPI.COMM_WORLD
bad_rank = int(sys.argv[1])
if comm.rank == bad_rank:
    raise ValueError(f"rank {bad_rank} raises on purpose while the others wait")
comm.recv(source=bad_rank, tag=1)  # never satisfied
