"""The tiny DeepSeek-style model (MLA, MoE, MTP) and its single-process reference generator.

Torch-free: kv_blocks (paged KV bookkeeping), tokenizer, shapes (presets). Torch: layers, mla,
moe, block, mtp, transformer, weights, sampling, reference. Nothing is imported here so that
the torch-free modules stay cheap to import.
"""
