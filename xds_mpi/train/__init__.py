"""Training the tiny model on the standard library's own sources, and measuring what it learned.

corpus (byte-level text split by file), forward (full-sequence causal forward through the model's
own modules), trainer (AdamW + cosine, MTP loss), stats (expert load, MTP acceptance, perplexity).
"""
