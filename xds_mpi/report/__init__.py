"""Run files, traces, progress and the report."""
