"""XCCL A2E/E2A with trampolines (Figure 8)."""
