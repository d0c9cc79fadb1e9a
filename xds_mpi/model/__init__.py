"""The tiny DeepSeek-style model (MLA, MoE, MTP) and its single-process reference generator.

numpy only, shared by the dies and the reference (docs/design.md: a die imports no torch). The
torch twin that trains the checkpoint and serves as the tests' oracle is
xds_mpi/train/torch_model.py. Nothing is imported here so that each module stays cheap to import.
"""
