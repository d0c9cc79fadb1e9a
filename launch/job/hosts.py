"""`xds-mpi run --hosts`: place the ranks on named hosts without a batch system.

The ranks are laid out as a Slurm job lays them out (launch/slurm/world.py `world_layout`: one
TE's by default one host per server, host ranks on the first; a cluster's whole TEs per host,
the JE on the first), written to a hostfile in the format of the detected MPI, and the
matching flags are added to the mpiexec line. How the launcher reaches
the hosts is the MPI's business: ssh by default; MPICH's hydra takes another command in
$HYDRA_LAUNCHER_EXEC (the two-host tests use one that enters a network namespace).
"""

from __future__ import annotations

import os
from pathlib import Path

from launch.job.mpiexec import MpiFlavor, find_mpiexec, mpi_flavor
from launch.slurm.jobscript import NodeLayout
from launch.slurm.world import world_layout
from xds_mpi.config.schema import ConfigError
from xds_mpi.plan.deployment import DeploymentPlan


def placement_flags(
    hosts: str | None, plan: DeploymentPlan, mpiexec: str | None, *, dry_run: bool
) -> tuple[str, ...]:
    """With --hosts: the hostfile under run.output_dir/hosts (printed instead on a dry run) and
    the mpiexec flags that use it; without, nothing."""
    if not hosts:
        return ()
    flavor = mpi_flavor(mpiexec or find_mpiexec())
    names = parse_hosts(hosts)
    text = hostfile_text(world_layout(plan, len(names)), names, flavor)
    path = (Path(plan.cfg.run.output_dir) / "hosts" / f"hosts-{os.getpid()}").resolve()
    if dry_run:
        print("".join(f"# {path}: {line}\n" for line in text.splitlines()), end="")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return hostfile_flags(path, flavor)


def parse_hosts(text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in text.split(","))
    if not all(hosts) or len(set(hosts)) != len(hosts):
        raise ConfigError(f"--hosts wants distinct comma-separated host names, got {text!r}")
    return hosts


def hostfile_text(layout: NodeLayout, hosts: tuple[str, ...], flavor: MpiFlavor) -> str:
    """One line per host with the number of consecutive ranks it runs (layout: one node per
    host)."""
    if flavor == "openmpi":
        lines = [f"{h} slots={n}" for h, n in zip(hosts, layout.tasks_per_node, strict=True)]
    else:
        lines = [f"{h}:{n}" for h, n in zip(hosts, layout.tasks_per_node, strict=True)]
    return "\n".join(lines) + "\n"


def hostfile_flags(path: Path, flavor: MpiFlavor) -> tuple[str, ...]:
    if flavor == "openmpi":
        return ("--hostfile", str(path), "--map-by", "slot")
    if flavor == "mpich":
        return ("-f", str(path))
    raise ConfigError("--hosts needs MPICH or Open MPI; this mpiexec is neither")
