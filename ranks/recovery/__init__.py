"""Failure detection and recovery (§6): heartbeats, the detector, recompute, scale-down, memory
faults."""
