"""What a run measured about expert load: per time slice, and per placement version (the
static placement is version 0), for the TE-shell's summary and the run file's `eplb` group."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xds_mpi.eplb.policy import max_over_mean

SCALED_BATCH = 60  # requests per die of the projected scaled load (xDeepServe's decode batch)


@dataclass(frozen=True, kw_only=True)
class SliceTotals:
    """One time slice over every DP group.

    counts: [num_moe_layers, num_experts] tokens per logical expert (all groups summed).
    die_rows: [num_moe_layers, num_dies] routed rows each die received (its measured load).
    moe_s: virtual seconds of MoE operations over the slice (the slowest die's).
    version_start / version_end: placement in use at its start / end; num_loading: iterations
    that ran while replica weights loaded; num_prefill: the most iterations any die prefilled in;
    load_s: the slowest die's load time so far."""

    counts: np.ndarray
    die_rows: np.ndarray
    moe_s: float
    num_iterations: int
    version_start: int
    version_end: int
    num_loading: int
    num_prefill: int
    load_s: float

    @classmethod
    def from_parts(cls, parts: list) -> SliceTotals:
        """parts: the slice's CountSlice of every DP group, in die order; None for a die lost
        to vertical scaling (its die_rows column: nan, which max_over_mean leaves out)."""
        given = [p for p in parts if p is not None]
        first, lost = given[0], np.full(len(given[0].rows_in), np.nan)
        rows = [lost if p is None else p.rows_in for p in parts]
        parts = given
        return cls(
            counts=np.sum([p.counts for p in parts], axis=0),
            die_rows=np.stack(rows, axis=1),
            moe_s=max(p.moe_vtime_s for p in parts),
            num_iterations=first.num_iterations,
            version_start=first.version_start,
            version_end=first.version_end,
            num_loading=max(p.num_loading for p in parts),
            num_prefill=max(p.num_prefill for p in parts),
            load_s=max(p.load_s for p in parts),
        )

    @property
    def is_steady(self) -> bool:
        """One placement throughout, no weights loading, decode steps only: a measurement of
        the placement that one of another placement can be compared with."""
        is_one_version = self.version_start == self.version_end
        return is_one_version and self.num_loading == 0 and self.num_prefill == 0


@dataclass(frozen=True, kw_only=True)
class Reconfig:
    """One placement the TE-shell sent to the dies. after_slice: the last time slice it was
    computed from; predicted_*: per layer max/mean die load of the kept slices' counts under the
    placement in use and the new one; phy2log: the new placement [layers][slots]."""

    version: int
    after_slice: int
    num_changed_slots: int
    predicted_before: tuple[float, ...]
    predicted_after: tuple[float, ...]
    phy2log: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, kw_only=True)
class VersionLoad:
    """The steady slices of one placement version: die_rows [num_moe_layers, num_dies] summed;
    max_over_mean per layer; moe_ms_per_iteration: virtual MoE time per iteration."""

    version: int
    num_iterations: int
    die_rows: np.ndarray
    max_over_mean: tuple[float, ...]
    moe_ms_per_iteration: float
    projected_moe_ms: float = float("nan")
    projected_moe_ms_scaled: float = float("nan")


def _version_load(version: int, steady: list, pricing, target_rows: float) -> VersionLoad:
    rows = np.sum([s.die_rows for s in steady], axis=0)  # [layers, dies]
    num_iterations = sum(s.num_iterations for s in steady)
    return VersionLoad(
        version=version,
        num_iterations=num_iterations,
        die_rows=rows,
        max_over_mean=tuple(max_over_mean(r) for r in rows),
        moe_ms_per_iteration=1e3 * sum(s.moe_s for s in steady) / num_iterations,
        **_projected(pricing, rows / num_iterations, target_rows),
    )


def _projected(pricing, rows_per_iteration: np.ndarray, target_rows: float) -> dict:
    """rows_per_iteration: [layers, dies]; the projected MoE ms at this load and scaled."""
    if pricing is None:
        return {}
    mean = float(np.nanmean(rows_per_iteration[0]))  # nan: a die lost to vertical scaling
    scale = target_rows / mean if target_rows and mean > 0 else float("nan")
    return {
        "projected_moe_ms": pricing.ms(rows_per_iteration),
        "projected_moe_ms_scaled": pricing.ms(rows_per_iteration, scale),
    }


@dataclass(frozen=True, kw_only=True)
class EplbReport:
    """versions: each placement's steady slices (v0: the static placement, before any swap);
    after: every rebalanced placement's steady slices pooled (version -1), None if none."""

    versions: tuple[VersionLoad, ...]
    after: VersionLoad | None
    reconfigs: tuple[Reconfig, ...]
    scalings: tuple[int, ...]  # versions that vertical scaling installed (ranks/shell/eplb.py)
    num_loading_iterations: int
    load_ms: float
    slices: tuple[SliceTotals, ...]

    @classmethod
    def from_slices(
        cls,
        slices: list[SliceTotals],
        reconfigs: list[Reconfig],
        pricing=None,
        target_rows=0.0,
        scalings: tuple[int, ...] = (),
    ) -> EplbReport:
        """pricing: a MoePricing for the projected MoE time; target_rows: mean routed rows per
        die and MoE layer for the scaled projection (0: none); scalings: the versions vertical
        scaling installed (the newest placement without the lost dies' slots)."""
        loads = []
        for version in [0, *(r.version for r in reconfigs)]:
            steady = [s for s in slices if s.is_steady and s.version_start == version]
            if steady:
                loads.append(_version_load(version, steady, pricing, target_rows))
        after = [s for s in slices if s.is_steady and s.version_start > 0]
        pooled = _version_load(-1, after, pricing, target_rows) if after else None
        return cls(
            versions=tuple(loads),
            after=pooled,
            reconfigs=tuple(reconfigs),
            scalings=tuple(scalings),
            num_loading_iterations=sum(s.num_loading for s in slices),
            load_ms=1e3 * max((s.load_s for s in slices), default=0.0),
            slices=tuple(slices),
        )

    @property
    def num_reconfigs(self) -> int:
        """Reconfigurations the dies installed (phase 4 ran): the newest version in use."""
        return max((s.version_end for s in self.slices), default=0)

    @property
    def num_decided(self) -> int:
        """Placements the TE-shell computed; the last may arrive after decoding ended."""
        return len(self.reconfigs)

    def lines(self) -> list[str]:
        """The summary: the swaps, then per placement version its measured load."""
        out = [
            f"EPLB: {self.num_reconfigs} reconfigurations installed ({self.num_decided} "
            f"decided); {self.num_loading_iterations} "
            f"iterations decoded while replica weights loaded ({self.load_ms:.2f} ms virtual "
            "load on the busiest die, overlapped)"
        ]
        if self.scalings:
            out.append(
                "EPLB after vertical scaling: placement version(s) "
                + ", ".join(f"v{v}" for v in self.scalings)
                + " installed at once on the survivors, without the lost dies' slots; newest "
                + "version in use "
                + f"v{self.num_reconfigs}"
            )
        for v in self.versions + ((self.after,) if self.after else ()):
            ratios = " ".join(f"{r:.2f}" for r in v.max_over_mean)
            name = f"v{v.version}" if v.version >= 0 else "after (v1+ pooled)"
            out.append(
                f"EPLB {name} ({v.num_iterations} steady iterations): max/mean die load per "
                f"MoE layer {ratios}; MoE {v.moe_ms_per_iteration:.2f} ms per iteration (virtual "
                f"clock), projected from these loads {v.projected_moe_ms:.2f} ms "
                f"({v.projected_moe_ms_scaled:.2f} ms at {SCALED_BATCH} requests per die); "
                f"routed rows per die per iteration, all MoE layers: "
                + " ".join(f"{r:.1f}" for r in v.die_rows.sum(axis=0) / v.num_iterations)
            )
        return out

    def summary(self) -> dict:
        """Scalars for the run summary: static (v0) and last placement's figures."""
        if not self.versions:
            return {"eplb_reconfigs": self.num_reconfigs}
        first, last = self.versions[0], self.after or self.versions[-1]
        return {
            "eplb_reconfigs": self.num_reconfigs,
            "eplb_loading_iterations": self.num_loading_iterations,
            "eplb_max_over_mean_first": float(np.nanmax(first.max_over_mean)),
            "eplb_max_over_mean_after": float(np.nanmax(last.max_over_mean)),
            "eplb_moe_ms_first": first.moe_ms_per_iteration,
            "eplb_moe_ms_after": last.moe_ms_per_iteration,
            "eplb_projected_moe_ms_first": first.projected_moe_ms,
            "eplb_projected_moe_ms_after": last.projected_moe_ms,
        }

    def write(self, f) -> None:
        """Group `eplb`: per slice and per version datasets (h5py file `f`)."""
        g = f.create_group("eplb")
        g.attrs["num_reconfigs"] = self.num_reconfigs
        g.attrs["num_decided"] = self.num_decided
        g.attrs["num_loading_iterations"] = self.num_loading_iterations
        g.attrs["load_ms"] = self.load_ms
        g["scaling_version"] = np.array(self.scalings, np.int64)
        if self.slices:
            g["slice_counts"] = np.stack([s.counts for s in self.slices])  # [S, layers, E]
            g["slice_die_rows"] = np.stack([s.die_rows for s in self.slices])  # [S, layers, dies]
            for name in (
                "version_start",
                "version_end",
                "num_loading",
                "num_prefill",
                "num_iterations",
            ):
                g[f"slice_{name}"] = np.array([getattr(s, name) for s in self.slices])
            g["slice_moe_s"] = np.array([s.moe_s for s in self.slices])
        if self.reconfigs:
            g["reconfig_version"] = np.array([r.version for r in self.reconfigs])
            g["reconfig_after_slice"] = np.array([r.after_slice for r in self.reconfigs])
            g["reconfig_changed_slots"] = np.array([r.num_changed_slots for r in self.reconfigs])
            g["reconfig_predicted_before"] = np.array([r.predicted_before for r in self.reconfigs])
            g["reconfig_predicted_after"] = np.array([r.predicted_after for r in self.reconfigs])
            g["reconfig_phy2log"] = np.array([r.phy2log for r in self.reconfigs])  # [n, L, slots]
        for v in self.versions + ((self.after,) if self.after else ()):
            vg = g.create_group(f"v{v.version}" if v.version >= 0 else "after")
            vg["die_rows"] = v.die_rows  # [layers, dies]
            vg["max_over_mean"] = np.array(v.max_over_mean)
            vg.attrs["num_iterations"] = v.num_iterations
            vg.attrs["moe_ms_per_iteration"] = v.moe_ms_per_iteration
            vg.attrs["projected_moe_ms"] = v.projected_moe_ms
            vg.attrs["projected_moe_ms_scaled"] = v.projected_moe_ms_scaled
