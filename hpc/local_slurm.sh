#!/usr/bin/env bash
# A real single-node Slurm on this machine, for the Slurm tests (facts: docs/mpi.md §7).
#
#   hpc/local_slurm.sh start            install if missing, start munged + slurmctld + slurmd,
#                                       print `export SLURM_CONF=...` (eval it, or source $R/env)
#   hpc/local_slurm.sh stop             cancel our jobs, stop exactly the daemons `start` started
#   hpc/local_slurm.sh status           which of our daemons run, and the node's state
#   hpc/local_slurm.sh run-tests CMD..  start, run CMD with SLURM_CONF and XDS_MPI_SLURM=1, stop
#
# Everything lives under $XDS_SLURM_DIR (default /tmp/xds-mpi-slurm): config, state, logs, the
# munge key and socket, and the PID file of each daemon. No systemd: the daemons run in the
# foreground (-F/-D) in their own sessions, and we keep their PIDs. Needs root (apt-get, munged,
# slurmd) and the ports 6817/6818 free. Safe to run twice: `start` on a running cluster only
# prints the environment; `stop` without a cluster does nothing.
set -euo pipefail

R=${XDS_SLURM_DIR:-/tmp/xds-mpi-slurm}
HOST=$(hostname -s)
# Export first: every Slurm client, even `sinfo --version`, fails without it (gotcha 1).
export SLURM_CONF=$R/etc/slurm.conf
DAEMONS=(munged slurmctld slurmd)    # start order; stop runs in reverse

say() { echo "local_slurm: $*" >&2; }
die() { say "error: $*"; exit 1; }

pid_of() { [ -s "$R/run/$1.started" ] && cat "$R/run/$1.started" || true; }

# A PID counts as our daemon only while it runs the same program: PIDs get reused. A zombie
# (state Z) is dead even though `kill -0` succeeds; PID 1 reaps orphans late (gotcha 5).
is_running() {
    local name=$1 pid=$2 state
    [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] || return 1
    state=$(sed -E 's/^[0-9]+ \(.*\) ([A-Za-z]).*/\1/' "/proc/$pid/stat" 2>/dev/null) || return 1
    [ "$state" != Z ]
}

all_running() {
    local name
    for name in "${DAEMONS[@]}"; do is_running "$name" "$(pid_of "$name")" || return 1; done
}

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null && command -v mungekey >/dev/null && return 0
    [ "$(id -u)" = 0 ] || die "Slurm is not installed and installing it needs root (apt-get)"
    say "installing slurmctld slurmd slurm-client munge"
    # Keeps the packages' postinst scripts from starting system-wide daemons.
    [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
                                       chmod +x /usr/sbin/policy-rc.d; }
    apt-get update -qq
    # Without --no-install-recommends apt pulls in ~40 packages instead of 8 (gotcha 11).
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >"$R/log/apt.log" 2>&1 \
        || { tail -n 20 "$R/log/apt.log" >&2; die "apt-get install failed (log: $R/log/apt.log)"; }
}

write_config() {
    local cpus
    cpus=$(nproc)
    cat >"$SLURM_CONF" <<EOF
# Written by hpc/local_slurm.sh: one node ($HOST, $cpus CPUs) on 127.0.0.1, state under $R.
ClusterName=xdsmpi
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$R/munge/munge.socket.2
StateSaveLocation=$R/state
SlurmdSpoolDir=$R/spool/slurmd
SlurmctldPidFile=$R/run/slurmctld.pid
SlurmdPidFile=$R/run/slurmd.pid
SlurmctldLogFile=$R/log/slurmctld.log
SlurmdLogFile=$R/log/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# pmi2, not Slurm's default none: with none, srun starts N separate size-1 MPI jobs and exits 0.
MpiDefault=pmi2
DependencyParameters=kill_invalid_depend
ReturnToService=2
KillWait=5
# Finished jobs stay visible to scontrol for 5 minutes, long enough to read their final state.
MinJobAge=300
# Start array elements and the first job at once instead of 3 s apart (gotcha 9).
SchedulerParameters=batch_sched_delay=0
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
}

# Start one daemon in its own session (so a Ctrl-C or a killed process group of the caller does
# not reach it) and keep its PID.
launch() {
    local name=$1; shift
    setsid "$@" </dev/null >"$R/log/$name.out" 2>&1 &
    echo $! >"$R/run/$name.started"
}

wait_for() {   # wait_for SECONDS WHAT CONDITION...
    local seconds=$1 what=$2; shift 2
    local deadline=$((SECONDS + seconds))
    until "$@"; do
        [ $SECONDS -lt $deadline ] || { say "no $what after ${seconds} s; logs in $R/log:"
                                        tail -n 5 "$R"/log/*.out "$R"/log/*.log >&2 || true
                                        return 1; }
        sleep 0.2
    done
}

socket_ready() { [ -S "$R/munge/munge.socket.2" ]; }
node_idle() { sinfo -h -N -o %T 2>/dev/null | grep -qx idle; }
daemon_alive() { is_running "$1" "$(pid_of "$1")"; }

print_env() {
    echo "export SLURM_CONF=$SLURM_CONF" >"$R/env"
    echo "export SLURM_CONF=$SLURM_CONF"
}

cmd_start() {
    mkdir -p "$R"/{etc,log,state,spool/slurmd,run,munge}
    if all_running; then
        say "already running (daemons $(for n in "${DAEMONS[@]}"; do printf '%s ' "$(pid_of "$n")"; done)under $R)"
        print_env
        return 0
    fi
    cmd_stop_quiet    # a half-started cluster from an earlier run: stop what is left of it
    local t0=$SECONDS name port
    install_packages
    for port in 6817 6818; do
        ! ss -ltn 2>/dev/null | grep -q ":$port " \
            || die "port $port is in use (another Slurm?); stop it first: $(ss -ltnp | grep ":$port " || true)"
    done
    # munged refuses a socket directory without execute permission for all (gotcha 3).
    chmod 755 "$R/munge"
    [ -s "$R/munge/munge.key" ] || mungekey -c -k "$R/munge/munge.key" -f
    chmod 600 "$R/munge/munge.key"
    write_config
    launch munged munged -F --socket="$R/munge/munge.socket.2" --key-file="$R/munge/munge.key" \
        --log-file="$R/log/munged.log" --pid-file="$R/munge/munged.pid" \
        --seed-file="$R/munge/munged.seed"
    wait_for 10 "munge socket" socket_ready || { cmd_stop_quiet; die "munged did not start"; }
    launch slurmctld slurmctld -D -c        # -c: cold start, ignore state left by an earlier run
    launch slurmd slurmd -D
    wait_for 60 "idle node" node_idle || { cmd_stop_quiet; die "the node did not become idle"; }
    for name in "${DAEMONS[@]}"; do
        daemon_alive "$name" || { cmd_stop_quiet; die "$name exited; see $R/log/$name.out"; }
    done
    say "Slurm up in $((SECONDS - t0)) s: node $HOST idle, SLURM_CONF=$SLURM_CONF"
    print_env
}

# Stop one daemon: TERM, then up to 20 s for it to exit (or turn zombie), then KILL.
stop_daemon() {
    local name=$1 pid i
    pid=$(pid_of "$name")
    if is_running "$name" "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do is_running "$name" "$pid" || break; sleep 0.2; done
        if is_running "$name" "$pid"; then
            say "$name ($pid) ignored SIGTERM for 20 s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        say "stopped $name ($pid)"
    fi
    rm -f "$R/run/$name.started"
}

cmd_stop_quiet() {
    local i
    if daemon_alive slurmctld; then
        # Jobs first, so slurmd does not leave job steps behind.
        scancel --user="$(id -un)" 2>/dev/null || true
        for ((i = 0; i < 50; i++)); do
            [ -z "$(squeue -h 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
    for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do stop_daemon "${DAEMONS[i]}"; done
}

cmd_stop() {
    [ -d "$R/run" ] || { say "nothing to stop under $R"; return 0; }
    cmd_stop_quiet
}

cmd_status() {
    local name pid
    for name in "${DAEMONS[@]}"; do
        pid=$(pid_of "$name")
        if is_running "$name" "$pid"; then echo "$name: running ($pid)"; else echo "$name: stopped"; fi
    done
    daemon_alive slurmctld && sinfo -N -o '%N %T %c' || true
}

cmd_run_tests() {
    [ $# -gt 0 ] || die "run-tests needs a command, e.g. run-tests python -m pytest tests"
    STARTED_HERE=1
    all_running && STARTED_HERE=0
    # Stop on any exit (a global: the trap runs after this function returned), but only a
    # cluster this call brought up.
    trap '[ "$STARTED_HERE" = 1 ] && cmd_stop_quiet' EXIT
    cmd_start >/dev/null
    set +e
    XDS_MPI_SLURM=1 "$@"
    local rc=$?
    set -e
    return $rc
}

case ${1:-} in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    run-tests) shift; cmd_run_tests "$@" ;;
    *) echo "usage: $0 start|stop|status|run-tests CMD..." >&2; exit 2 ;;
esac
