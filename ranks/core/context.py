"""What a role program is given: the deployment plan (config, topology, XCCL layouts and window
sizes), its own entry, the communicator."""

from __future__ import annotations

import json
import logging
import zlib
from dataclasses import dataclass

from mpi4py import MPI

from xds_mpi.config.schema import Config
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.plan.topology import RankInfo, Topology


@dataclass(frozen=True, kw_only=True)
class RankContext:
    plan: DeploymentPlan  # built for comm.size: every rank derives the same one
    comm: MPI.Comm
    log: logging.Logger
    node_leader: int  # the lowest world rank sharing this rank's memory node

    @property
    def cfg(self) -> Config:
        return self.plan.cfg

    @property
    def topo(self) -> Topology:
        return self.plan.topo

    @property
    def info(self) -> RankInfo:
        return self.topo.ranks[self.comm.rank]

    @property
    def name(self) -> str:
        """How errors and logs name this rank: 'die 3 (rank 4, colocated)' or 'rank 0 (host)'."""
        info = self.info
        if info.is_die:
            return f"die {info.die_idx} (rank {info.rank}, {info.role})"
        return f"rank {info.rank} (host)"

    def config_digest(self) -> str:
        """Identifies the config a rank loaded, so ranks that read different files are caught.
        A CRC-32 (zlib, which mpi4py loads anyway): it tells accidental differences apart as
        well as a cryptographic hash would, without hashlib's OpenSSL load in every rank."""
        text = json.dumps(self.cfg.to_dict(), sort_keys=True, default=str)
        return f"{zlib.crc32(text.encode()):08x}"
