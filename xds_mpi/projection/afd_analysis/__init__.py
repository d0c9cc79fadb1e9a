"""Seed 003's analysis of MoE-attention disaggregation: its budget method (`budget.py`), the
inputs it reads from a config or a platform (`inputs.py`) and the paper's own numbers
(`paper.py`); docs/afd_analysis.md."""
