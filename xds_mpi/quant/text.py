"""Calibration and evaluation text as numpy windows: the checkpoint's own corpus (the stdlib's
sources, xds_mpi/train/corpus.py), calibration from the training files, evaluation from the
held-out files, so no evaluated token was seen during calibration."""

from __future__ import annotations

import numpy as np


def corpus_streams(*, max_files: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(training stream, held-out stream): [tokens] int64 each."""
    from xds_mpi.train.corpus import load_corpus  # imports torch: only when reading the corpus

    corpus = load_corpus(max_files=max_files)
    return corpus.train.numpy().astype(np.int64), corpus.heldout.numpy().astype(np.int64)


def random_windows(
    stream: np.ndarray, *, num_windows: int, window_len: int, seed: int | list[int]
) -> np.ndarray:
    """num_windows windows at seeded random offsets -> [num_windows, window_len] int64."""
    if len(stream) < window_len:
        raise ValueError(f"a stream of {len(stream)} tokens is shorter than {window_len}")
    starts = np.random.default_rng(seed).integers(0, len(stream) - window_len + 1, num_windows)
    return np.stack([stream[s : s + window_len] for s in starts])


def spread_windows(stream: np.ndarray, *, num_windows: int, window_len: int) -> np.ndarray:
    """num_windows windows evenly spread over the stream -> [num_windows, window_len] int64."""
    if len(stream) < window_len:
        raise ValueError(f"a stream of {len(stream)} tokens is shorter than {window_len}")
    last = len(stream) - window_len
    starts = [last * i // max(1, num_windows - 1) for i in range(num_windows)]
    return np.stack([stream[s : s + window_len] for s in starts])
