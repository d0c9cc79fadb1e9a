"""Requests as the TE-shell receives them and the stream they come in: synthetic, a JSONL file of
prompts, or a window of a production trace."""
