"""Execution on a die: one iteration's batch through the model with XCCL between the layers, its
price on the virtual clock, the two-stream decode, a prefill TP group, MTP bookkeeping, expert
slots, the rank's runtime, and where injected XCCL errors strike."""
