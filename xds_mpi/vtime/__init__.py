"""Virtual-time serving (run.clock virtual, docs/virtual_time.md): the TE-shell's decisions on
the dies' 910C clock (`admission`) and the per-request times it yields (`results`)."""
