"""Shape-aware GEMM costs and a per-kernel fixed cost, from public micro-benchmark rows.

A kernel takes a fixed time (its start, prologue and tail: CloudMatrix-Infer §4.2.2, graph
capture "does not eliminate the per-operator startup cost on the NPU") plus a roofline at the
efficiencies its shape reaches:

    t = fixed + max(2 x groups x pad(M) x N x K / (peak x compute(M)),
                    bytes / (HBM x memory(N, K)))

Step 1 (calibration, `KernelCosts.fit`): from rows (groups, M per group, N, K, achieved TFLOPS,
achieved GB/s) of one library on one device: the rows with M <= 128 are memory-bound (their
arithmetic intensity is under the device's ridge); least squares of t = fixed + bytes / (HBM x
memory) over them gives the fixed cost and a bandwidth efficiency (each (N, K) shape's own: the
mean over its rows of what the fixed cost leaves); the rows
with M >= 256 are compute-bound and give compute(M) = FLOPs / ((t - fixed) x peak), the median
over the shapes at each M, log-linear in M between the points and flat beyond them.
Step 2 (`KernelCosts.carried`): a device whose table has only large-M rows (the 910C's [001]
Table 10, M = 2,048-7,168) takes its own large-M efficiency times the other device's
compute(M) / compute(large M) at decode shapes, and its own MLA bandwidth efficiency times the
other's GEMM / MLA bandwidth ratio: an assumption, labelled, whose spread over the other
device's rows is a band (`KernelCosts.bands`).
pad(M): the matrix unit computes whole tiles of `tile_m` rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from xds_mpi.config.hardware import load_profile

SMALL_M = 128  # rows at or under this are memory-bound on both devices' tables
LARGE_M = 2048  # rows at or over this are the "large M" a carried ratio is taken against


@dataclass(frozen=True, kw_only=True)
class GemmRow:
    """One measured GEMM: `groups` x [M x K] @ [K x N], achieved TFLOPS and GB/s."""

    groups: int
    m: int
    n: int
    k: int
    tflops: float
    gb_per_s: float

    @property
    def flops(self) -> float:
        return 2.0 * self.groups * self.m * self.n * self.k

    @property
    def seconds(self) -> float:
        return self.flops / (self.tflops * 1e12)

    @property
    def nbytes(self) -> float:
        return self.seconds * self.gb_per_s * 1e9


@dataclass(frozen=True)
class Curve:
    """A value against M: log-linear between (M, value) points, flat beyond the ends."""

    points: tuple[tuple[float, float], ...]

    def at(self, m: float) -> float:
        ms = [math.log(p[0]) for p in self.points]
        return float(np.interp(math.log(max(m, 1.0)), ms, [p[1] for p in self.points]))

    def scaled(self, factor: float) -> Curve:
        return Curve(tuple((m, v * factor) for m, v in self.points))


@dataclass(frozen=True, kw_only=True)
class KernelCosts:
    """fixed_s: every kernel's fixed time; compute: a GEMM's achieved/peak math against M per
    group; memory: achieved/peak HBM per (N, K) shape, `memory_default` for a shape not in the
    table; tile_m: rows of the matrix unit's tile; source: where the numbers come from."""

    fixed_s: float
    compute: Curve
    memory: dict = field(default_factory=dict)  # (n, k) -> efficiency
    memory_default: float
    tile_m: int
    source: str = ""

    def gemm_s(self, *, m: float, params: float, n: int | None = None, groups: float = 1,
               peak: float, hbm: float, weight_bytes: float,
               act_bytes: float = 1.0) -> float:  # fmt: skip
        """The roofline part of one GEMM kernel (the fixed time is counted per kernel by the
        caller): `groups` x [m x k] @ [k x n], params = k x n weights of `weight_bytes` each,
        activations in at `act_bytes` and out in BF16 (n None: the weights alone, and the
        bandwidth of a shape not in the table)."""
        if m <= 0 or groups <= 0:
            return 0.0
        padded = math.ceil(m / self.tile_m) * self.tile_m
        flops = 2.0 * groups * padded * params
        k = params / n if n else 0.0
        acts = m * (k * act_bytes + 2 * n) if n else 0.0
        nbytes = groups * (params * weight_bytes + acts)
        eff_mem = self.memory.get((n, round(k)), self.memory_default)
        return max(flops / (peak * self.compute.at(m)), nbytes / (hbm * eff_mem))

    @classmethod
    def fit(cls, rows: list[GemmRow], *, peak: float, hbm: float, tile_m: int,
            source: str) -> KernelCosts:  # fmt: skip
        """Step 1 (module docstring): fixed cost and per-shape bandwidth from the small-M rows,
        compute(M) from the large ones."""
        small = [r for r in rows if r.m <= SMALL_M]
        # t = fixed + bytes / (hbm x eff): one fixed cost and one bandwidth over every small
        # row (a fixed cost per shape is not identifiable from two rows of nearly equal bytes)
        design = np.array([[1.0, r.nbytes] for r in small])
        coef, *_ = np.linalg.lstsq(design, np.array([r.seconds for r in small]), rcond=None)
        fixed = max(0.0, float(coef[0]))
        # then each shape's own bandwidth, the mean over its rows of what the fixed cost leaves
        memory: dict[tuple[int, int], float] = {}
        for shape in sorted({(r.n, r.k) for r in small}):
            mine = [r for r in small if (r.n, r.k) == shape]
            mean = sum(r.nbytes / ((r.seconds - fixed) * hbm) for r in mine) / len(mine)
            # a shape faster than the common fixed cost allows (DeepGEMM's N = 7168, K = 2048
            # rows) is held at the HBM peak: the fixed cost is a mean, not that shape's own
            memory[shape] = min(1.0, mean)
        by_m: dict[int, list[float]] = {}
        for r in rows:
            if r.m > SMALL_M:
                by_m.setdefault(r.m, []).append(r.flops / ((r.seconds - fixed) * peak))
        compute = Curve(tuple((m, _median(v)) for m, v in sorted(by_m.items())))
        return cls(fixed_s=fixed, compute=compute, memory=memory,
                   memory_default=1.0 / (float(coef[1]) * hbm), tile_m=tile_m,
                   source=source)  # fmt: skip

    def compute_ratio(self, m: float) -> float:
        """compute(m) over compute at large M (the median of the points at or over LARGE_M)."""
        return self.compute.at(m) / self.large_m_compute()

    def large_m_compute(self) -> float:
        return _median([v for m, v in self.compute.points if m >= LARGE_M])

    @classmethod
    def carried(cls, other: KernelCosts, *, rows: list[GemmRow], peak: float, tile_m: int,
                other_mla_mem: float, mla_mem: float, fixed_s: float,
                source: str) -> KernelCosts:  # fmt: skip
        """Step 2 (module docstring): this device's large-M rows (their median utilization
        against `peak`) times the other device's small-M compute ratio; its MLA bandwidth
        efficiency times the other's GEMM / MLA bandwidth ratio, shape by shape; the fixed
        cost given (the other's, or a band's end)."""
        large = _median([r.tflops * 1e12 / peak for r in rows])
        compute = other.compute.scaled(large / other.large_m_compute())
        ratio = mla_mem / other_mla_mem
        memory = {s: e * ratio for s, e in other.memory.items()}
        return cls(fixed_s=fixed_s, compute=compute, memory=memory,
                   memory_default=other.memory_default * ratio, tile_m=tile_m,
                   source=source)  # fmt: skip

    def with_fixed(self, fixed_s: float) -> KernelCosts:
        return replace(self, fixed_s=fixed_s)

    def scaled(self, *, compute: float = 1.0, memory: float = 1.0) -> KernelCosts:
        """The same costs with the efficiencies scaled (a band's end)."""
        return replace(
            self,
            compute=self.compute.scaled(compute),
            memory={s: e * memory for s, e in self.memory.items()},
            memory_default=self.memory_default * memory,
        )


def spread(rows: list[GemmRow], costs: KernelCosts, *, peak: float, hbm: float,
           weight_bytes: float = 1.0) -> tuple[float, float]:  # fmt: skip
    """(lowest, highest) of measured / modelled time over `rows`: how far a row of the table
    the costs were fitted to sits from the fit, the spread a carried ratio takes with it."""
    ratios = [
        r.seconds
        / (costs.fixed_s + costs.gemm_s(m=r.m, params=r.n * r.k, n=r.n, groups=r.groups,
                                        peak=peak, hbm=hbm, weight_bytes=weight_bytes))
        for r in rows
    ]  # fmt: skip
    return min(ratios), max(ratios)


def operator_costs(profile: dict) -> KernelCosts | None:
    """A hardware profile's GEMM costs: fitted to its `operators.gemm_rows` (Step 1), carried
    from `operators.carried_from`'s where its rows are large-M only (Step 2), or, for a profile
    without a GEMM table (the default ascend910c), None: cost.py's flat path, one efficiency per
    class of operator and no fixed cost (the profile's `efficiency` section, as before issue 61)."""
    eff, die, ops = profile["efficiency"], profile["die"], profile.get("operators")
    hbm = die["hbm_tb_per_s"] * 1e12
    if not ops:
        return None
    rows = gemm_rows(profile)
    peak = ops["gemm_peak_tops"] * 1e12
    if "carried_from" not in ops:
        name = f"fitted to {profile['name']}'s {len(rows)} GEMM rows"
        return KernelCosts.fit(rows, peak=peak, hbm=hbm, tile_m=ops["tile_m"], source=name)
    other_profile = load_profile(ops["carried_from"])
    other = operator_costs(other_profile)
    return KernelCosts.carried(
        other, rows=rows, peak=peak, tile_m=ops["tile_m"],
        other_mla_mem=other_profile["efficiency"]["memory"], mla_mem=eff["memory"],
        fixed_s=other.fixed_s,
        source=f"{profile['name']}'s large-M rows x {ops['carried_from']}'s small-M ratio "
        "(assumption)",
    )  # fmt: skip


def gemm_rows(profile: dict) -> list[GemmRow]:
    """The profile's measured GEMM rows (operators.gemm_rows: groups, M, N, K, TFLOPS, GB/s)."""
    return [GemmRow(groups=g, m=m, n=n, k=k, tflops=t, gb_per_s=b)
            for g, m, n, k, t, b in profile["operators"]["gemm_rows"]]  # fmt: skip


def _median(values) -> float:
    """statistics.median's value (the middle one, or the mean of the middle two), without importing
    statistics into every die (tests/unit/launch/test_rank_imports.py)."""
    ordered = sorted(values)
    half = len(ordered) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2
