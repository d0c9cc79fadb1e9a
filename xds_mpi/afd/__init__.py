"""Disaggregated MoE-attention (xDeepServe §5.2): the calls' plan, the attention die's execution
and pricing, and the expert dies' measured load with its comparison to the budget method."""
