"""Many colocated TEs behind one job executor (docs/cluster.md): the JE's program (je.py) and
the TE-shell's side of the JE -> TE-shell link (te_side.py)."""
