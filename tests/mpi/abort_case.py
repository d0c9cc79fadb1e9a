"""One rank fails an assertion while the others wait in a barrier; the harness must end the job.
Not a body of the regular suite: tests/e2e/bodies/test_harness.py runs it on purpose."""

import pytest
from mpi4py import MPI


@pytest.mark.mpi(min_size=2)
def test_one_rank_fails_while_others_wait():
    comm = MPI.COMM_WORLD
    assert comm.rank != 1, "die 0 (rank 1) found a wrong token"
    comm.Barrier()  # rank 1 never arrives
