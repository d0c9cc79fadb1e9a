"""`xds-mpi plan` (docs/planning.md): the capacity planner's command, its outputs (table, plot,
one config per frontier point) and its verification by emulation."""
