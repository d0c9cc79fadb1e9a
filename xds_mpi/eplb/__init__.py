"""Expert load balancing (xDeepServe §4.5): the pure algorithm (placement, policies) and the
pieces a die and the TE-shell run around it (docs/design.md, "Expert load balancing")."""
