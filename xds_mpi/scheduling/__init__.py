"""Policy, never compute: the TE-shell's DP load balancer and a die's continuous-batching
scheduler."""
