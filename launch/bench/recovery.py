"""`xds-mpi bench recovery`: the recovery policies that apply to one fault scenario, compared on
the virtual clock (issue 62, docs/failures.md "Recovery policies compared").

The same workload (a trace window or the synthetic one) is served once without a fault and once
per scenario and policy, each an `xds-mpi run --check` on the virtual clock, so every number is
on the dies' 910C clock and the same on every run. A scenario is a `faults.events` list; a
policy a set of `--set` overrides (health.replicas, EPLB's redundant slots, on_expert_lost,
faults.on_timeout, the heartbeat timeouts). Per run the table gives the goodput, the requests
lost, the time to detect, to resume and to recover, the tokens prefilled again, the iterations
recomputed, TTFT/TPOT p99 and the check's mismatches (xds_mpi/results/recovery.py reads them
from the run file); a run the validator refuses is a row with the reason, a run that stops on a
lost expert a row with its stop. The plot draws each run's TTFT and goodput over virtual time
with the fault marked.

A command rather than a list of `xds-mpi run` lines: the baseline, the matching of requests
across runs (time to recover) and the refused and stopped runs need one place that runs them all.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from launch.bench.results import report
from launch.serve.bench import run_launcher
from xds_mpi.config.paths import DEFAULT_CONFIG, resolve_config
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.plan.topology import Topology
from xds_mpi.results.recovery import RecoveryRun, goodput_over_time, read_recovery, recovered_s

COLUMNS = ["scenario", "policy", "outcome", "goodput", "lost", "detect_s", "resume_s"]
COLUMNS += ["recover_s", "reprefilled", "recomputed", "ttft_p99_ms", "tpot_p99_ms", "mismatches"]
NO_FAULT = "no fault"


@dataclass(frozen=True, kw_only=True)
class Policy:
    """A named recovery policy: the overrides it sets and what it means."""

    name: str
    sets: tuple[str, ...]
    meaning: str


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """One run of the comparison: its run read back (None: refused before launch, `refusal`
    says why)."""

    scenario: str
    policy: str
    run: RecoveryRun | None
    refusal: str = ""


def builtin_policies(config: Path, sets: list[str]) -> dict[str, Policy]:
    """The policies a name selects, sized for this deployment (ring and EPLB need as many
    redundant slots per die as a die holds routed experts)."""
    cfg = load_config(config, sets)
    topo = Topology.from_config(cfg)
    routed = max(
        sum(1 for s in info.expert_slots if s.kind == "routed")
        for info in topo.ranks
        if any(s.kind == "routed" for s in info.expert_slots)
    )
    slots = f"deployment.redundant_slots_per_die={routed}"
    eplb = ("eplb.enabled=true", "eplb.interval=8", "eplb.slices=2")
    return {
        p.name: p
        for p in (
            Policy(
                name="ring",
                sets=("health.replicas=ring", slots),
                meaning="each die's redundant slots hold the next die's experts: vertical scaling",
            ),
            Policy(
                name="ring-fast",
                sets=("health.replicas=ring", slots, "health.timeout_s=4"),
                meaning="ring with health.timeout_s 4 (default 10): detection and release sooner",
            ),
            Policy(
                name="eplb",
                sets=("health.replicas=none", slots, *eplb),
                meaning="EPLB's redundant slots only: scaled away if they cover the lost experts",
            ),
            Policy(
                name="ring+eplb",
                sets=(
                    "health.replicas=ring",
                    f"deployment.redundant_slots_per_die={routed + 1}",
                    *eplb,
                ),
                meaning="ring replicas, and EPLB balancing one more slot per die",
            ),
            Policy(
                name="stop",
                sets=("health.replicas=none", "health.on_expert_lost=stop"),
                meaning="no replica: the run stops naming the experts lost (the default)",
            ),
            Policy(
                name="restart",
                sets=("health.replicas=none", "health.on_expert_lost=restart"),
                meaning="stage 1: rebuild the decode side on the remaining dies",
            ),
            Policy(
                name="recompute",
                sets=(
                    "health.replicas=ring",
                    slots,
                    "faults.on_timeout=recompute",
                    "xccl.poll_timeout_s=0.5",
                ),
                meaning="ring, and an XCCL wait that times out recomputes the iteration",
            ),
        )
    }


def policies_of(args: argparse.Namespace) -> list[Policy]:
    """--policies (built-in names) then --policy NAME=SETS (custom), in that order."""
    builtin = builtin_policies(args.config, args.set)
    out = []
    for name in args.policies:
        if name not in builtin:
            raise ConfigError(f"bench recovery: unknown policy {name!r} (known: {list(builtin)})")
        out.append(builtin[name])
    for given in args.policy:
        name, _, sets = given.partition("=")
        out.append(Policy(name=name, sets=tuple(shlex.split(sets)), meaning="--policy"))
    if not out:
        raise ConfigError(
            "bench recovery: no policy: give --policies NAME... or --policy NAME=SETS"
        )
    return out


def scenarios_of(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, faults.events rows) of each --scenario NAME=ROWS."""
    out = []
    for given in args.scenario:
        name, sep, rows = given.partition("=")
        if not sep or not rows.strip().startswith("["):
            raise ConfigError(
                f"bench recovery: --scenario {given!r}: give NAME=[rows], e.g. "
                "'dead=[{kind: dead, die: 2, at_s: 8}]'"
            )
        out.append((name, rows))
    if not out:
        raise ConfigError("bench recovery: give at least one --scenario NAME=[rows]")
    return out


def serve(args: argparse.Namespace, sets: list[str]) -> tuple[RecoveryRun | None, str]:
    """One `xds-mpi run --check` on the virtual clock: (its run read back, "") or (None, the
    refusal) when no run file was written."""
    with tempfile.TemporaryDirectory(prefix="xds-bench-recovery-") as tmp:
        sets = [*args.set, *sets, "run.clock=virtual", "run.trace=false", f"run.output_dir={tmp}"]
        command = [sys.executable, "-m", "launch.cli.main", "run", str(args.config), "--check"]
        command += [a for s in sets for a in ("--set", s)]
        done = run_launcher(command, cwd=Path.cwd(), env=None, timeout_s=args.timeout)
        files = list(Path(tmp).glob("*.h5"))
        if not files:
            errors = [ln for ln in done.stderr.splitlines() if "error" in ln]
            return None, (errors[-1] if errors else done.stderr[-300:]).strip()
        return read_recovery(files[0]), ""


def row_of(outcome: Outcome, baseline: RecoveryRun | None, slack_s: float) -> dict:
    """The table's row (virtual seconds, ms for the percentiles)."""
    row = dict.fromkeys(COLUMNS, "-")
    row.update(scenario=outcome.scenario, policy=outcome.policy)
    run = outcome.run
    if run is None:
        row["outcome"] = f"refused: {outcome.refusal.removeprefix('xds-mpi: error: ')[:80]}"
        return row
    row["detect_s"] = _seconds(run.detect_s)
    if not run.is_completed:
        row["outcome"] = f"stopped ({run.verdict} die, experts lost)"
        row["lost"] = "all open"
        return row
    recover = recovered_s(run, baseline, slack_s=slack_s) if baseline else math.nan
    row.update(
        outcome=run.verdict or "served",
        goodput=f"{run.goodput_requests}/{run.num_requests}",
        lost=str(len(run.lost)) + (f" {[r for r, _ in run.lost]}" if run.lost else ""),
        resume_s=_seconds(run.resume_s),
        recover_s=_seconds(recover) if not math.isnan(run.fault_s) else "-",
        reprefilled=f"{run.reprefill_tokens}{'' if run.reprefill_is_exact else '+'}",
        recomputed=run.recomputed_iterations,
        ttft_p99_ms=f"{run.ttft_p99_ms:.0f}",
        tpot_p99_ms=f"{run.tpot_p99_ms:.0f}",
        mismatches=run.check_mismatches,
    )
    if run.fault_s >= 0 and math.isnan(recover) and baseline:
        row["recover_s"] = "> window"
    return row


def _seconds(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def plot(outcomes: list[Outcome], path: Path, title: str) -> None:
    """Each completed run's virtual TTFT per request against its arrival, and its goodput over
    virtual time (requests finished within the SLOs), the fault and the failover marked (Agg:
    no display)."""
    # here: matplotlib, a measured start-up cost of every command
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_good) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    for o in outcomes:
        run = o.run
        if run is None or not run.is_completed:
            continue
        label = NO_FAULT if o.scenario == NO_FAULT else f"{o.scenario} / {o.policy}"
        order = run.requests.arrival_s.argsort()
        ttft = run.requests.ttft_s[order]
        (line,) = ax_ttft.plot(run.requests.arrival_s[order], ttft, ".-", ms=3, lw=0.8, label=label)
        finish, count = goodput_over_time(run)
        ax_good.step([0, *finish], [0, *count], where="post", color=line.get_color(), label=label)
        for ax in (ax_ttft, ax_good):
            if not math.isnan(run.fault_s):
                ax.axvline(run.fault_s, color=line.get_color(), ls="--", lw=1)
            if not math.isnan(run.resumed_s):
                ax.axvspan(run.fault_s, run.resumed_s, color=line.get_color(), alpha=0.08)
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("virtual TTFT (s)")
    ax_ttft.legend(fontsize=8)
    ax_ttft.set_xlabel("arrival (virtual s)")
    ax_good.set_ylabel("requests finished within the SLOs")
    ax_good.set_xlabel("virtual s; dashed: the fault; shaded: fault -> resumption")
    for ax in (ax_ttft, ax_good):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cmd_bench_recovery(args: argparse.Namespace) -> int:
    args.config = resolve_config(args.config)
    scenarios, policies = scenarios_of(args), policies_of(args)
    runs = [(NO_FAULT, Policy(name="-", sets=(), meaning="the config as given"), "[]")]
    runs += [(name, p, rows) for name, rows in scenarios for p in policies]
    outcomes = []
    for scenario, policy, rows in runs:
        run, refusal = serve(args, [*policy.sets, f"faults.events={rows}"])
        outcomes.append(Outcome(scenario=scenario, policy=policy.name, run=run, refusal=refusal))
        print(f"  {scenario} / {policy.name}: {_said(outcomes[-1])}", flush=True)
    baseline = outcomes[0].run
    args.profile = load_config(args.config, args.set).hardware.profile
    title = f"xds-mpi bench recovery: {args.config.name}, virtual clock"
    table = [row_of(o, baseline, args.slack_ms / 1e3) for o in outcomes]
    report(table, COLUMNS, args, title=title, legend=_legend(policies, args.slack_ms))
    for o in outcomes:
        for req_id, reason in o.run.lost if o.run else ():
            print(f"  {o.scenario} / {o.policy}: request {req_id} lost: {reason}")
    plot(outcomes, Path(args.plot), title)
    print(f"plot: {args.plot}")
    return 0 if all(o.run is None or o.run.check_mismatches <= 0 for o in outcomes) else 1


def _said(o: Outcome) -> str:
    if o.run is None:
        return f"refused ({o.refusal})"
    if not o.run.is_completed:
        return o.run.status[:160]
    return f"completed, check {o.run.check_mismatches} mismatches"


def _legend(policies: list[Policy], slack_ms: float) -> str:
    lines = [
        "virtual 910C clock, seconds after the fault: detect_s to the detection, resume_s to the "
        "first decision after it (the survivors' resumption when a request moved), recover_s "
        f"to the arrival from which every request's TTFT is within {slack_ms:g} ms of the "
        "fault-free run's ('> window': not within the window); goodput: requests meeting "
        "run.slo_ttft_ms and run.slo_tpot_ms over the window's; reprefilled: the moved "
        "requests' prompt and emitted tokens ('+': emitted tokens before the fault not dated "
        "in the run file); recomputed: iterations rolled back and run again; mismatches: "
        "--check against the reference (-1: not checked).",
    ]
    lines += [f"  {p.name}: {p.meaning} ({' '.join(p.sets)})" for p in policies]
    return "\n".join(lines)


def add_parser(kinds) -> None:
    p = kinds.add_parser(
        "recovery",
        help="recovery policies for one fault scenario compared on the virtual clock",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="a config (virtual clock)")
    p.add_argument(
        "--scenario",
        action="append",
        default=[],
        metavar="NAME=[ROWS]",
        help="a faults.events list, e.g. 'dead=[{kind: dead, die: 2, at_s: 8}]' (repeatable)",
    )
    p.add_argument(
        "--policies",
        nargs="*",
        default=[],
        help="built-in policies: ring ring-fast eplb ring+eplb stop restart recompute",
    )
    p.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="NAME=SETS",
        help="a policy of your own: NAME='key=value key=value' (repeatable)",
    )
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument(
        "--slack-ms", type=float, default=250, help="TTFT slack of recover_s (default 250)"
    )
    p.add_argument("--plot", default="bench_recovery.png", help="where the plot goes (PNG)")
    p.add_argument("--out", default="", help="write the table to FILE.csv or FILE.h5")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed")
    p.set_defaults(func=cmd_bench_recovery)
