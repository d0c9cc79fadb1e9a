"""Many TEs behind one job executor (docs/cluster.md): the JE's routing policies and their
bookkeeping, pure (no MPI)."""
