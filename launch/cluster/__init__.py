"""Commands about a cluster of TEs behind a job executor (docs/cluster.md): `xds-mpi heatmap`
(heatmap.py), the study that makes the map the `pd_heatmap` policy reads."""
