"""`xds-mpi project` (command.py) and its parts: the paper's tables (paper.py), AFD (afd.py), skew
(skew.py), sweeps (sweep.py); `python -m launch.project.eplb_compare` prices two run files."""
