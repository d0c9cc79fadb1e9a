"""Disaggregated MoE-attention (§5.2): attention dies and expert dies."""
