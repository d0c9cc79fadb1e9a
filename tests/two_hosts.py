"""Two "hosts" on one machine: two network namespaces joined by a veth pair, each with its own
host name, so MPI sees two nodes and XCCL takes its cross-node path (docs/mpi.md §8).

Root only (the CI runs as root). Everything is created here and removed afterwards, even when
the test fails: the namespaces (their veth pair and processes go with them) and the per-namespace
/etc/netns/<ns>/hosts files. Only the addresses made here are used, and only inside the two
namespaces: 10.77.0.1 (host 0, where mpiexec runs) and 10.77.0.2 (host 1).
MPICH's hydra reaches host 1 through a launcher shim ($HYDRA_LAUNCHER_EXEC) that enters the
namespace instead of ssh; UCX must be told `UCX_TLS=tcp,self` or it keeps using shared memory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from launch.job.mpiexec import MpiCommand

ADDRESSES = ("10.77.0.1", "10.77.0.2")
# `on NS HOST CMD...`: run CMD as host HOST. `ip netns exec` is not enough: it mounts a fresh
# /sys, which has no cgroups (slurmd needs them); without a fresh /sys, UCX lists the machine's
# network devices instead of the namespace's. So: a private mount namespace, the namespace's
# network, a fresh sysfs with the machine's cgroups bound back in, the host's own /etc/hosts and
# host name.
ON = """#!/bin/sh
ns=$1 host=$2; shift 2
exec unshare --mount --uts nsenter --net=/var/run/netns/$ns sh -c '
  mount --make-rprivate / &&
  mkdir -p /run/xds-cgroup && mount --rbind /sys/fs/cgroup /run/xds-cgroup &&
  mount -t sysfs sysfs /sys && mount --rbind /run/xds-cgroup /sys/fs/cgroup &&
  mount --bind /etc/netns/$0/hosts /etc/hosts && hostname "$1" && shift && exec "$@"
' "$ns" "$host" "$@"
"""
# hydra's launcher in place of ssh: `shim [ssh options] HOST COMMAND-LINE`.
SHIM = """#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
host=$1; shift
case "$host" in
{cases}
  *) echo "two-hosts shim: unknown host $host" >&2; exit 255;;
esac
exec {on} "$ns" "$host" sh -c "$*"
"""


def can_make_hosts() -> str:
    """Why two hosts cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (the CI runs as root)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: iproute2, util-linux)"
    return ""


@dataclass(frozen=True, kw_only=True)
class TwoHosts:
    names: tuple[str, str]  # host names, resolvable inside both namespaces
    namespaces: tuple[str, str]
    addresses: tuple[str, str]
    on_script: Path
    shim: Path

    @property
    def env(self) -> dict[str, str]:
        """What an MPICH job needs to reach host 1 and to cross over TCP."""
        return {
            "HYDRA_LAUNCHER": "ssh",
            "HYDRA_LAUNCHER_EXEC": str(self.shim),
            "UCX_TLS": "tcp,self",
        }

    def on(self, idx: int, argv: list[str] | tuple[str, ...]) -> list[str]:
        """`argv` run on host `idx`."""
        return [str(self.on_script), self.namespaces[idx], self.names[idx], *argv]

    def wrap(self, command: MpiCommand) -> MpiCommand:
        """An mpiexec line run on host 0 with the launcher environment."""
        return MpiCommand(argv=tuple(self.on(0, command.argv)), env={**command.env, **self.env})


@contextlib.contextmanager
def two_hosts(workdir: Path) -> Iterator[TwoHosts]:
    tag = f"{os.getpid() % 100000}"
    namespaces = (f"xds{tag}h0", f"xds{tag}h1")
    names = ("xds-h0", "xds-h1")
    try:
        _create(namespaces, names, tag)
        on_script = _script(workdir / "on-host", ON)
        cases = "\n".join(f"  {n}) ns={ns};;" for n, ns in zip(names, namespaces, strict=True))
        shim = _script(workdir / "two-hosts-shim", SHIM.format(cases=cases, on=on_script))
        yield TwoHosts(
            names=names, namespaces=namespaces, addresses=ADDRESSES, on_script=on_script, shim=shim
        )
    finally:
        _remove(namespaces)


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def _create(namespaces: tuple[str, str], names: tuple[str, str], tag: str) -> None:
    veth = (f"xv{tag}a", f"xv{tag}b")
    hosts = "127.0.0.1 localhost\n" + "".join(
        f"{a} {n}\n" for a, n in zip(ADDRESSES, names, strict=True)
    )
    _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
    for ns, dev, address in zip(namespaces, veth, ADDRESSES, strict=True):
        _ip("netns", "add", ns)
        _ip("link", "set", dev, "netns", ns)
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
        _ip("-n", ns, "link", "set", dev, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts)


def _remove(namespaces: tuple[str, str]) -> None:
    for ns in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
