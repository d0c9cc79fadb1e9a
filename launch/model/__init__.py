"""Model tools: `xds-mpi train-tiny` and `stats` (train.py), `quantize` (quantize.py), `generate`
(generate.py)."""
