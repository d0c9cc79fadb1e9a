"""The cost model and the projection onto the pod; the paper table."""
