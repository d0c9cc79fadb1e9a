"""Engine parts: requests, workloads, the TE-shell's DP load balancer, the per-die scheduler,
and the executor that runs a batch through the model with XCCL between the layers."""
