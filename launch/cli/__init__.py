"""`xds-mpi`: the argument parser, the sub-commands' dispatch, and `validate` and `run`
(main.py). `python -m launch.cli` runs it too."""
