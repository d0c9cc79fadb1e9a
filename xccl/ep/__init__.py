"""XCCL dispatch/combine (Figure 7): pull-based, optional fused INT8."""
