"""Log lines that carry the rank and role of the process that wrote them."""

from __future__ import annotations

import logging
import sys


def setup_logging(rank: int, role: str, level: str = "info") -> logging.Logger:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s.%(msecs)03d [r{rank} {role}] %(levelname)s %(message)s", "%H:%M:%S"
        )
    )
    logger = logging.getLogger("xds_mpi")
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False
    return logger
