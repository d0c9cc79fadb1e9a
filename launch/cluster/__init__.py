"""Commands about a cluster of TEs behind a job executor (docs/cluster.md): `xds-mpi heatmap`
(heatmap.py), the study that makes the map the `pd_heatmap` policy reads, and `xds-mpi predict`
(predict.py), the JE's decode-length model trained and measured on a trace."""
