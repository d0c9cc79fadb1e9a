"""The MPI job: its mpiexec line and how it runs and stops (mpiexec.py), each rank's entry point
(rank.py), start-up (prepare.py, startup.py, dataclass_cache.py), hosts (hosts.py), the node's
memory (memory_guard.py), shared memory left behind (shm_leftovers.py) and the ranks' log lines
(log.py). Imports nothing here: a rank imports this package before its dataclass cache is on."""
