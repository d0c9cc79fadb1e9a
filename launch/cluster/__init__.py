"""Commands for many TEs behind one job executor: `xds-mpi predict` (predict.py), the JE's
decode-length model trained and measured on a trace."""
