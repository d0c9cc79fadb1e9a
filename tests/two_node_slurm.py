"""A real two-node Slurm on one machine: one slurmd per "host" of tests/two_hosts.py (each with
its NodeName and NodeAddr), slurmctld on host 0 reachable from both, munged with its own socket.
Started for a test and stopped afterwards, even on failure (the processes in the namespaces die
with them; munged is stopped by PID). Facts it relies on: docs/mpi.md §8.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from two_hosts import TwoHosts

# The nodes claim 8 CPUs (config_overrides): a server's ranks outnumber this machine's 2 CPUs,
# and Slurm 22.05 refuses --ntasks-per-node above a node's CPUs even with --overcommit.
CONF = """ClusterName=xdstwo
SlurmctldHost={h0}({a0})
SlurmUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket.2
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmi2
ReturnToService=2
KillWait=5
MinJobAge=300
SchedulerParameters=batch_sched_delay=0
SlurmdParameters=config_overrides
NodeName={h0} NodeAddr={a0} {node}
NodeName={h1} NodeAddr={a1} {node}
PartitionName=two Nodes={h0},{h1} Default=YES MaxTime=INFINITE State=UP
"""


def slurm_missing() -> str:
    """Why the two-node Slurm cannot start here ("" when it can)."""
    for tool in ("slurmctld", "slurmd", "sbatch", "munged", "mungekey"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (hpc/local_slurm.sh installs Slurm)"
    return ""


@dataclass(frozen=True, kw_only=True)
class TwoNodeSlurm:
    hosts: TwoHosts
    conf: Path

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, xds-mpi submit, ...) on host 0."""
        env = {**os.environ, "SLURM_CONF": str(self.conf), "UCX_TLS": "tcp,self"}
        env.pop("HYDRA_LAUNCHER", None)  # inside a job hydra starts its proxies through srun
        return subprocess.run(
            self.hosts.on(0, argv), env=env, capture_output=True, text=True, **kwargs
        )


@contextlib.contextmanager
def two_node_slurm(hosts: TwoHosts, root: Path) -> Iterator[TwoNodeSlurm]:
    for sub in ("etc", "log", "state", "spool", "run", "munge"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "etc" / "slurm.conf"
    h0, h1 = hosts.names
    a0, a1 = hosts.addresses
    node = "CPUs=8 Boards=1 SocketsPerBoard=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=1000"
    conf.write_text(CONF.format(r=root, h0=h0, h1=h1, a0=a0, a1=a1, node=node))
    cluster = TwoNodeSlurm(hosts=hosts, conf=conf)
    daemons: list[subprocess.Popen] = []
    try:
        daemons.append(_start_munge(root))
        daemons.append(_daemon(cluster, 0, root, "slurmctld", ["slurmctld", "-D", "-c"]))
        for idx, name in enumerate(hosts.names):
            argv = ["slurmd", "-D", "-N", name]
            daemons.append(_daemon(cluster, idx, root, f"slurmd-{name}", argv))
        _wait_idle(cluster, root)
        yield cluster
    finally:
        for proc in reversed(daemons):  # each exec'd into its daemon: the PID is the daemon's
            proc.kill()
            proc.wait()


def _start_munge(root: Path) -> subprocess.Popen:
    munge = root / "munge"
    munge.chmod(0o755)  # munged refuses a socket directory others cannot enter
    key = munge / "munge.key"
    subprocess.run(["mungekey", "-c", "-k", str(key), "-f"], check=True, capture_output=True)
    key.chmod(0o600)
    argv = ["munged", "-F", f"--socket={munge}/munge.socket.2", f"--key-file={key}"]
    argv += [f"--log-file={root}/log/munged.log", f"--pid-file={munge}/munged.pid"]
    argv += [f"--seed-file={munge}/munged.seed"]
    with open(root / "log" / "munged.out", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    _wait(lambda: (munge / "munge.socket.2").exists(), 10, "the munge socket", root)
    return proc


def _daemon(
    cluster: TwoNodeSlurm, idx: int, root: Path, name: str, argv: list[str]
) -> subprocess.Popen:
    """Start a daemon in the foreground on host `idx`, its output in log/NAME.out."""
    env = {**os.environ, "SLURM_CONF": str(cluster.conf)}
    with open(root / "log" / f"{name}.out", "w") as log:
        return subprocess.Popen(
            cluster.hosts.on(idx, argv),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_idle(cluster: TwoNodeSlurm, root: Path) -> None:
    def both_idle() -> bool:
        out = cluster.run(["sinfo", "-h", "-N", "-o", "%T"], timeout=30).stdout.split()
        return out == ["idle", "idle"]

    _wait(both_idle, 90, "two idle nodes", root)


def _wait(ready, seconds: float, what: str, root: Path) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            logs = "".join(
                f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((root / "log").iterdir())
            )
            raise RuntimeError(f"two-node Slurm: no {what} after {seconds:g} s\n{logs}")
        time.sleep(0.5)
