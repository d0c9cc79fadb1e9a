"""Host ranks: the TE-shell (frontend, decode-side shell with PD) and the JE."""
