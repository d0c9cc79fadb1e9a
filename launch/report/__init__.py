"""What the launcher shows a reader. Two ideas: text tables for the terminal (tables.py: the rank
map `validate` prints, and the table every command's output uses) and a run file's report as one
self-contained HTML page (run_page.py: `xds-mpi report`)."""
