"""Prefill-decode disaggregation (xDeepServe §5.1): the JE's routing, prefill scheduling, the
PD-transfer task and its KV bytes, KV-path failover and the results a PD run adds."""
