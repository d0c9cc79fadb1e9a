"""Text every Python installation ships: the standard library's own .py sources, byte-level.

Files are listed in sorted order under `sysconfig.get_paths()["stdlib"]` (third-party packages
and the stdlib's test suites left out). A file is held out when crc32 of its relative path is
divisible by HELDOUT_MODULUS, so the split does not move when another Python adds or drops files.
Each file becomes [BOS] + its UTF-8 bytes + [EOS], as `ByteTokenizer.encode` starts a prompt.
"""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from xds_mpi.model.tokenizer import BOS_ID, EOS_ID

SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
HELDOUT_MODULUS = 10


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Sorted relative paths (POSIX) of the stdlib's .py files outside SKIPPED_DIRS."""
    root = stdlib_root() if root is None else root
    paths = (p.relative_to(root) for p in root.rglob("*.py"))
    return sorted(p.as_posix() for p in paths if not SKIPPED_DIRS & set(p.parts[:-1]))


def is_heldout(rel_path: str) -> bool:
    return zlib.crc32(rel_path.encode()) % HELDOUT_MODULUS == 0


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """Two token streams: every training file, then every held-out file, each file in order."""

    train: torch.Tensor  # [num_train_tokens] int16 token ids
    heldout: torch.Tensor  # [num_heldout_tokens] int16
    num_train_files: int
    num_heldout_files: int


def _encode_file(path: Path) -> list[int]:
    return [BOS_ID, *path.read_bytes(), EOS_ID]


def load_corpus(root: Path | None = None, *, max_files: int | None = None) -> Corpus:
    """`max_files` keeps the first files of the sorted list (tests train on a tiny slice)."""
    root = stdlib_root() if root is None else root
    files = stdlib_files(root)[:max_files]
    train, heldout = [], []
    for rel in files:
        (heldout if is_heldout(rel) else train).extend(_encode_file(root / rel))
    if not train or not heldout:
        raise ValueError(
            f"{root}: {len(files)} files gave {len(train)} training and "
            f"{len(heldout)} held-out tokens; both splits need text"
        )
    return Corpus(
        train=torch.tensor(train, dtype=torch.int16),
        heldout=torch.tensor(heldout, dtype=torch.int16),
        num_train_files=sum(not is_heldout(r) for r in files),
        num_heldout_files=sum(is_heldout(r) for r in files),
    )


def random_windows(
    stream: torch.Tensor, *, num_windows: int, window_len: int, generator: torch.Generator
) -> torch.Tensor:
    """num_windows windows at seeded random offsets -> [num_windows, window_len] int64."""
    if len(stream) < window_len:
        raise ValueError(
            f"a stream of {len(stream)} tokens is shorter than one window ({window_len} tokens)"
        )
    starts = torch.randint(0, len(stream) - window_len + 1, (num_windows,), generator=generator)
    return torch.stack([stream[s : s + window_len] for s in starts.tolist()]).long()


def spread_windows(stream: torch.Tensor, *, num_windows: int, window_len: int) -> torch.Tensor:
    """num_windows windows evenly spread over the stream (a fixed evaluation set)
    -> [num_windows, window_len] int64."""
    if len(stream) < window_len:
        raise ValueError(
            f"a stream of {len(stream)} tokens is shorter than one window ({window_len} tokens)"
        )
    last = len(stream) - window_len
    starts = [last * i // max(1, num_windows - 1) for i in range(num_windows)]
    return torch.stack([stream[s : s + window_len] for s in starts]).long()
