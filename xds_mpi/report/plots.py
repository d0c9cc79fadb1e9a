"""The report's figures (matplotlib, headless Agg backend), one function each: a run in, a
PNG out. A figure whose data the run does not have says so inside it rather than vanishing."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display, CI included
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from xds_mpi.report.data import RunData  # noqa: E402
from xds_mpi.report.pool_plot import pool  # noqa: E402

DPI = 80


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _empty(ax, why: str) -> None:
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def breakdown(run: RunData, path: Path) -> Path:
    """Figure 20 style: each iteration's projected time by operation, stacked (mean over dies)."""
    fig, ax = plt.subplots(figsize=(9, 4))
    if not run.breakdown:
        _empty(ax, "no trace beside the run file (run.trace: false)")
    else:
        x = np.arange(len(run.breakdown["other"]))
        bottom = np.zeros(len(x))
        for part, ms in run.breakdown.items():
            ax.bar(x, ms, bottom=bottom, label=part, width=0.9)
            bottom += ms
        ax.set_xlabel("iteration")
        ax.set_ylabel("projected ms (910C clock, mean over dies)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"{run.name}: per-operation breakdown per iteration")
    return _save(fig, path)


def die_times(run: RunData, path: Path) -> Path:
    """Each die's wall and virtual seconds per iteration."""
    fig, (wall, virtual) = plt.subplots(1, 2, figsize=(10, 3.6))
    for rank, die in sorted(run.dies.items()):
        wall.plot(die["total_s"] * 1e3, label=f"rank {rank}", lw=1)
        virtual.plot(die["vtime_s"] * 1e3, label=f"rank {rank}", lw=1)
    wall.set(title="wall ms per iteration (this machine)", xlabel="iteration", ylabel="ms")
    virtual.set(title="projected 910C ms per iteration", xlabel="iteration", ylabel="ms")
    if run.dies:
        wall.legend(fontsize=7)
    fig.suptitle(run.name, fontsize=9)
    return _save(fig, path)


def expert_load(run: RunData, path: Path) -> Path:
    """Rows each routed expert received per MoE layer (Figure 11a's heatmap)."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    if run.expert_load is None:
        _empty(ax, "no expert load: no trace beside the run file")
    else:
        image = ax.imshow(run.expert_load, aspect="auto", cmap="viridis")
        ax.set_yticks(range(len(run.load_layers)), [f"layer {i}" for i in run.load_layers])
        ax.set_xlabel("logical expert")
        fig.colorbar(image, ax=ax, label="rows received")
    ax.set_title(f"{run.name}: expert load per layer and expert")
    return _save(fig, path)


def eplb(run: RunData, path: Path) -> Path:
    """EPLB: routed rows per die and MoE layer per iteration, before and after the swaps."""
    versions = sorted((k for k in run.eplb_loads if k != "after"), key=lambda k: int(k[1:]))
    shown = [k for k in (versions[:1] + ["after"]) if k in run.eplb_loads]  # before, after
    loads = {k: run.eplb_loads[k] for k in shown}
    fig, axes = plt.subplots(1, max(1, len(loads)), figsize=(10, 3.2), squeeze=False)
    if not loads:
        _empty(axes[0, 0], "no EPLB in this run")
    top = max((float(rows.max()) for rows in loads.values()), default=1.0)
    for ax, (label, rows) in zip(axes[0], loads.items()):
        image = ax.imshow(rows, aspect="auto", cmap="magma", vmin=0, vmax=top)
        ratios = rows.max(axis=1) / np.maximum(rows.mean(axis=1), 1e-9)
        ax.set_yticks(range(len(rows)), [f"MoE {i} ({r:.2f})" for i, r in enumerate(ratios)])
        ax.set_xlabel("die")
        name = "after (all later versions)" if label == "after" else f"before ({label})"
        ax.set_title(f"{name}: rows per iteration (max/mean)", fontsize=9)
        fig.colorbar(image, ax=ax)
    fig.suptitle(f"{run.name}: EPLB die load", fontsize=9)
    return _save(fig, path)


def latencies(run: RunData, path: Path) -> Path:
    """TTFT and TPOT histograms over the served requests, on the wall clock (the run file's
    /requests: tokens as the TE-shell took them); the projected 910C ones are in the summary."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, key, title in zip(axes, ("ttft_s", "tpot_s"), ("TTFT", "TPOT")):
        values = run.requests[key][np.isfinite(run.requests[key])] * 1e3
        if len(values):
            ax.hist(values, bins=min(20, max(len(values), 1)), color="tab:blue")
        else:
            _empty(ax, f"no {title}")
        ax.set(title=f"{title} distribution, wall clock", xlabel="wall ms", ylabel="requests")
    clock = run.summary.get("serving_clock", "")
    drove = f"; serving driven by the {clock} clock" if clock else ""
    fig.suptitle(
        f"{run.name}: TTFT and TPOT on this machine's wall clock (as the TE-shell took the "
        f"tokens; the projected 910C ones are in the summary){drove}",
        fontsize=8,
    )
    return _save(fig, path)


def mtp_acceptance(run: RunData, path: Path) -> Path:
    """MTP acceptance per DP group (die)."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ranks = run.summary.get("mtp_group_ranks")
    if ranks is None or not len(ranks):
        _empty(ax, "MTP off in this run (scheduler.mtp_depth = 0)")
    else:
        acceptance = np.asarray(run.summary["mtp_group_acceptance"]) * 100
        ax.bar([f"rank {r}" for r in ranks], acceptance, color="tab:green")
        ax.axhline(run.summary["mtp_acceptance"] * 100, color="k", ls="--", lw=1, label="all")
        ax.set(ylabel="drafts accepted (%)", ylim=(0, 100))
        ax.legend(fontsize=7)
    ax.set_title(f"{run.name}: MTP acceptance per DP group")
    return _save(fig, path)


def recovery(run: RunData, path: Path) -> Path:
    """Every failure record of the run file (a row each: injected, then detected and fenced, then
    (green) the verdict and the survivors' rebuild until they serve again, with what recovery
    did), and the trace's transient faults (markers), rollbacks and
    recomputed attempts (bars), on the wall clock from serving's start."""
    failures = failure_rows(run)
    fig, ax = plt.subplots(figsize=(10, 2.6 + 0.45 * len(failures) + 0.2 * len(failures)))
    rows = {"fault": 2, "rollback": 1, "recompute": 0}
    colors = {"fault": "tab:red", "rollback": "tab:orange", "recompute": "tab:purple"}
    for name, start, dur in run.recovery:
        if name == "fault":
            ax.plot([start], [rows[name]], "v", color=colors[name], ms=8)
        else:
            ax.barh(rows[name], max(dur, 1e-3), left=start, color=colors[name], height=0.6)
    ends = [s + d for _, s, d in run.recovery]
    for row, (label, _, injected, detected) in enumerate(failures, start=3):
        rows[label] = row
        resumed = run.failures[row - 3].get("resumed_wall_s", -1.0)
        ax.plot([injected], [row], "x", color="k", ms=8)
        if detected >= 0:  # detection to fence: the detector fences as it names the die
            ax.plot([injected, detected], [row, row], color="tab:red", lw=2)
            ax.plot([detected], [row], "|", color="tab:red", ms=14, mew=2)
        if detected >= 0 and resumed > detected:  # fence to serving again: verdict, rebuild
            ax.plot([detected, resumed], [row, row], color="tab:green", lw=4, alpha=0.7)
            ax.plot([resumed], [row], ">", color="tab:green", ms=7)
        if detected >= 0:
            note = _failover_note(injected, detected, resumed)
            ax.annotate(note, (injected, row), xytext=(0, 7), textcoords="offset points",
                        va="bottom", fontsize=7)  # fmt: skip
        ends.append(max(detected, injected, resumed))
    # what each failure cost, in words, under the axes (one line each)
    notes = [f"{label}: {text}" for label, text, _, _ in failures]
    if notes:
        fig.text(0.01, 0.01, "\n".join(notes), fontsize=7, va="bottom", wrap=True)
    if not run.recovery and not run.failures:
        ax.text(0.5, 0.5, "no failures, faults, rollbacks or recomputation", transform=ax.transAxes)
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_xlim(0, max([run.attrs.get("wall_time_s", 1.0)] + [1.15 * e for e in ends]))
    ax.set_ylim(-0.6, max(rows.values()) + 0.6)
    ax.set_xlabel("wall s since serving started (this machine's clock)")
    count = sum(1 for name, _, _ in run.recovery if name == "fault")
    where = "" if run.has_trace else " (no trace: transient faults not shown)"
    counted = int(run.summary.get("faults_injected", 0))
    if run.has_trace and counted > count:  # a served run keeps its newest trace events
        where = f" shown, {counted} injected (trace capped)"
    ax.set_title(
        f"{run.name}: {len(failures)} failure{'' if len(failures) == 1 else 's'} (x injected, "
        f"| detected and fenced), {count} transient faults{where}",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.04 + 0.06 * len(notes), 1, 1))  # room for the notes
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _failover_note(injected: float, detected: float, resumed: float) -> str:
    """The failover's stages in seconds: to detection and fence, then to serving again."""
    note = f"+{detected - injected:.2f} s detected, fenced"
    if resumed > detected:
        note += f"; +{resumed - detected:.2f} s verdict, rebuild, serving again"
    return note


def failure_rows(run: RunData) -> list[tuple[str, str, float, float]]:
    """One row per failure record: (label, what happened, injected s, detected s (-1: never)),
    wall seconds since serving started; the text gives the virtual times too."""
    out = []
    for f in run.failures:
        label = f"{f['kind']} {f['role']} die {f['die']}"
        injected, detected = f["injected_wall_s"], f["detected_wall_s"]
        if detected >= 0:
            found = (
                f"detected {detected - injected:.2f} s later by {f['detected_by']} "
                f"({f['verdict']}; virtual {f['injected_virtual_s']:.3f} -> "
                f"{f['detected_virtual_s']:.3f} s)"
            )
        else:
            found = "never detected"
        affected = len(f.get("requests_affected", ()))
        lost = len(f.get("requests_lost", ()))
        text = (
            f"iteration {f['injected_iteration']}: {found}; {f['recovery'] or 'no recovery'}; "
            f"{affected} requests moved, {lost} lost; tokens/s {f['tokens_per_s_before']:.1f} "
            f"-> {f['tokens_per_s_after']:.1f}"
        )
        out.append((label, text, injected, detected))
    return out


def serving_over_time(c: dict, num_tes: int) -> tuple[list[float], list[int]]:
    """The number of serving TEs over virtual time from the scale events: the non-standby TEs
    from 0, +1 at a scale-out's serving time, -1 at a drain's decision."""
    standby = c.get("te_standby", np.array([]))
    start = int(num_tes - np.count_nonzero(standby)) if len(standby) else num_tes
    changes = []
    scaling = c["scaling"]
    for kind, decided, serves in zip(
        scaling["kind"], scaling["decided_s"], scaling["serves_s"], strict=True
    ):
        changes.append((serves, 1) if kind == "out" else (decided, -1))
    times, counts, now = [0.0], [start], start
    end = float(np.nanmax(c["arrival_s"], initial=0.0))
    for t, step in sorted(changes):
        if np.isfinite(t):
            now += step
            times.append(float(t))
            counts.append(now)
    times.append(max(end, times[-1]))
    counts.append(now)
    return times, counts


def cluster(run: RunData, path: Path) -> Path:
    """A cluster's routing on the virtual clock: each request's TE at its routing time (a
    request routed again after its TE was lost drawn from its first TE), the TEs' losses and
    scale events; each TE's JCTs; the regret estimate per routed request (docs/routing.md)."""
    fig, axes = plt.subplots(
        1, 4, figsize=(18, 3.6), gridspec_kw={"width_ratios": [3, 2.2, 1.4, 1.4]}
    )
    c = run.cluster
    if not c:
        for ax in axes:
            _empty(ax, "not a cluster run")
        return _save(fig, path)
    num_tes = len(c["te_kind"]) or int(np.max(c["te"], initial=0)) + 1
    labels = [f"TE {k} ({c['te_kind'][k]})" if c["te_kind"] else f"TE {k}" for k in range(num_tes)]
    ax = axes[0]
    served = c["te"] >= 0
    colors = np.where(c["first_te"] != c["te"], "tab:red", "tab:blue")[served]
    ax.scatter(c["routed_s"][served], c["te"][served], s=10, c=colors)
    again = served & (c["first_te"] != c["te"])
    for t, a, b in zip(c["routed_s"][again], c["first_te"][again], c["te"][again], strict=True):
        ax.annotate("", (t, b), (t, a), arrowprops={"arrowstyle": "->", "color": "tab:red"})
    for k, lost_s in enumerate(c["te_lost_s"]):
        if np.isfinite(lost_s):
            ax.plot([lost_s], [k], "kx", ms=10)
    scaling = c["scaling"]
    step_s = scaling.get("step_s", np.zeros((len(scaling.get("kind", ())), 0)))
    shades = plt.get_cmap("Greens")(np.linspace(0.4, 0.9, max(step_s.shape[1], 1)))
    for i, (kind, te, decided) in enumerate(
        zip(
            scaling.get("kind", ()),
            scaling.get("te", ()),
            scaling.get("decided_s", ()),
            strict=True,
        )
    ):
        if kind != "out":
            ax.plot([decided], [te], marker="v", color="tab:orange", ms=8)
            continue
        start = decided  # the scaling steps, one shade each, from the decision to serving
        for k, seconds in enumerate(
            step_s[i] if step_s.shape[1] else [scaling["serves_s"][i] - decided]
        ):
            ax.plot([start, start + seconds], [te, te], color=shades[k], lw=5, alpha=0.8)
            start += seconds
    ax.set_yticks(range(num_tes), labels)
    ax.set_xlabel("routing time (virtual s)")
    ax.set_title(
        f"routing by {c['policy']}: red routed again, x lost, green scaling steps, v drained",
        fontsize=8,
    )
    ax = axes[1]  # the virtual TTFT over the arrivals; the serving TEs over time beside it
    ax.scatter(c["arrival_s"], c["ttft_s"] * 1e3, s=6, color="tab:blue")
    ax.set(title="TTFT over arrival (virtual)", xlabel="arrival (virtual s)", ylabel="TTFT ms")
    if scaling.get("kind"):
        times, counts = serving_over_time(c, num_tes)
        twin = ax.twinx()
        twin.step(times, counts, where="post", color="tab:green")
        twin.set_ylabel("serving TEs", color="tab:green")
        twin.set_ylim(0, num_tes + 0.5)
    ax = axes[2]
    jcts = [c["jct_s"][(c["te"] == k) & np.isfinite(c["jct_s"])] for k in range(num_tes)]
    if any(len(j) for j in jcts):
        ax.boxplot([j if len(j) else [np.nan] for j in jcts])
        ax.set_xticks(range(1, num_tes + 1), [str(k) for k in range(num_tes)])
    else:
        _empty(ax, "no JCT")
    ax.set(title="JCT per TE (virtual s)", xlabel="TE", ylabel="s")
    ax = axes[3]
    regret = c["regret_s"][np.isfinite(c["regret_s"])] * 1e3
    if len(regret):
        ax.hist(regret, bins=20, color="tab:purple")
        ax.set(title=f"regret, estimated: mean {regret.mean():.0f} ms", xlabel="ms")
    else:
        _empty(ax, "no regret estimate")
    fig.suptitle(f"{run.name}: a cluster of {num_tes} TEs behind one JE", fontsize=9)
    return _save(fig, path)


FIGURES = {
    "breakdown": breakdown,
    "die_times": die_times,
    "expert_load": expert_load,
    "eplb": eplb,
    "latency": latencies,
    "mtp": mtp_acceptance,
    "recovery": recovery,
    "cluster": cluster,
    "pool": pool,
}
