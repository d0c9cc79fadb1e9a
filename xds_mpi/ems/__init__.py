"""The EMS context cache (docs/ems.md): its logic free of MPI, what it adds to the results, and
the projected context-caching curve."""
