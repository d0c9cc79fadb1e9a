"""`xds-mpi bench p2p|ep|afd`: MPI benchmark programs (p2p.py, ep.py, afd.py, with their floors),
the commands that launch them (command.py, afd_command.py) and their result tables (results.py).
Kept apart from the tests; `bench serve` and `bench endpoint` are in launch/serve/."""
