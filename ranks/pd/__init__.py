"""Disaggregated prefill-decode (§5.1): prefill dies, the KV transfer's send and receive sides."""
