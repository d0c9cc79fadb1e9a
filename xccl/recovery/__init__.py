"""XCCL's side of failure handling: injected faults, the vote, rollback and fences."""
