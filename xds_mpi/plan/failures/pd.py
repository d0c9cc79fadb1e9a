"""The `stuck` / `dead` rows on a PD run's decode dies (xds_mpi/plan/failures/checks.py calls this):
what runs (ranks/recovery/decode_loss.py, ranks/recovery/je_decode_loss.py) and, refused before
launch with a reason, what does not."""

from __future__ import annotations

from xds_mpi.config.failures import FailureSpec
from xds_mpi.config.schema import Config, ConfigError
from xds_mpi.plan.failures.loss import release_bound_s
from xds_mpi.plan.topology import Topology

# Rows that share a PD run with a lost decode die: none (their recoveries are not built to run
# together: a link or saturation verdict, a prefill TE lost, or a memory fault meanwhile).
OTHER_KINDS = ("link", "saturated", "memory", "stuck", "dead")


def check_decode_loss(cfg: Config, topo: Topology, where: str, spec: FailureSpec) -> None:
    """A decode die lost in a PD run: found by the decode TE-shell's heartbeats, the survivors
    scale vertically (every expert keeps a ring replica), its requests move."""
    role = topo.ranks[spec.die].role
    if role != "colocated":
        return  # pd_afd decode sides: refused by EMULATED
    if cfg.deployment.num_host_ranks != 2:
        raise ConfigError(
            f"{where}: a lost decode die of a PD run is found by the decode TE-shell (host rank "
            f"1); deployment.num_host_ranks({cfg.deployment.num_host_ranks}) gives the JE the "
            "decode balancing and nobody watches the decode dies"
        )
    if spec.kind == "stuck" and spec.duration_s:
        raise ConfigError(
            f"{where}: a PD decode die stuck for duration_s({spec.duration_s}) comes back, and "
            "the decode TE-shell's failover has no path for a die that returns (as a transient "
            "or after the fence: the colocated TE-shell's readmission, without PD); only stuck "
            "for good (duration_s 0)"
        )
    if cfg.health.replicas != "ring":
        raise ConfigError(
            f"{where}: a lost PD decode die is emulated with health.replicas=ring (every expert "
            "keeps a replica, the survivors scale vertically); without one the run must stop, "
            "and a PD run's stop on an expert's last replica would need the JE to end the "
            "prefill side on the decode side's word, which is built without PD only"
        )
    if cfg.eplb.enabled:
        raise ConfigError(
            f"{where}: a lost PD decode die with eplb.enabled: the decode TE-shell's vertical "
            "scaling does not install EPLB's placement without the lost slots (the colocated "
            "TE-shell's does, without PD)"
        )
    others = [i for i, e in enumerate(cfg.faults.events) if e.kind in OTHER_KINDS and e is not spec]
    if others:
        raise ConfigError(
            f"{where}: a lost PD decode die with other fault rows (faults.events{others}) in one "
            "run: the decode TE-shell's failover and the other recoveries would have to agree on "
            "the requests each one moves, which they do not; one stuck/dead decode row per run"
        )
    health = cfg.health
    bound = release_bound_s(health)
    if health.probe_timeout_s <= bound:
        raise ConfigError(
            f"{where}: health.probe_timeout_s({health.probe_timeout_s:g}) must exceed detection "
            f"and release ({bound:g} s, as xccl.poll_timeout_s): until the fence releases them "
            "the surviving decode dies wait for the lost one and echo no link probe, and the "
            "prefill dies would call their pairs down (false link verdicts)"
        )
    decode = topo.ranks_with_role("colocated")
    if len(decode) < 2:
        raise ConfigError(f"{where}: decode die {spec.die} is the only decode die")
