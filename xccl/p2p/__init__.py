"""XCCL point-to-point send/receive (Figure 4): a ring of slots per ordered die pair."""
