"""The capacity planner behind `xds-mpi plan` (docs/planning.md): enumerate the deployments a
chip budget holds, price each with the projection's iteration cost and a discrete-event replay
of the workload's arrivals, rank them by goodput per chip and keep the Pareto frontier.

Nothing below xds_mpi/ imports this package; launch/plan/ drives it."""
