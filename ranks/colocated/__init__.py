"""The colocated die (Figure 10): attention for its DP group plus expert slots; its EPLB side."""
