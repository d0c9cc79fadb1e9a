"""Human-readable views of a topology: the rank map table `xds-mpi validate` prints."""

from __future__ import annotations

from xds_mpi.plan.topology import ExpertSlot, RankInfo, Topology


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1][-1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def describe_slots(slots: tuple[ExpertSlot, ...]) -> str:
    routed = [s.expert_idx for s in slots if s.kind == "routed"]
    shared = [s.expert_idx for s in slots if s.kind == "shared"]
    redundant = [s for s in slots if s.kind == "redundant"]
    words = []
    if routed:
        words.append(f"routed {_ranges(routed)}")
    if shared:
        words.append(f"shared {_ranges(shared)}")
    if redundant:
        filled = [str(s.expert_idx) for s in redundant if s.expert_idx >= 0]
        words.append(f"redundant x{len(redundant)}" + (f" ({','.join(filled)})" if filled else ""))
    return "; ".join(words) or "-"


def _cell(value: int) -> str:
    return "-" if value < 0 else str(value)


def rank_row(info: RankInfo) -> list[str]:
    where = "-" if not info.is_die else f"{info.server}/{info.chip}/{info.die_in_chip}"
    return [
        str(info.rank),
        info.role,
        _cell(info.die_idx),
        where,
        _cell(info.dp_domain),
        _cell(info.dp_group),
        describe_slots(info.expert_slots),
        f"for group {info.trampoline_for}" if info.is_trampoline else "-",
    ]


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def rank_map(topo: Topology, extra: dict[str, list[str]] | None = None) -> str:
    """The rank map; `extra` adds columns (name -> one cell per rank), e.g. window bytes."""
    headers = [
        "rank",
        "role",
        "die",
        "server/chip/die",
        "DP domain",
        "DP group",
        "experts",
        "trampoline",
    ]
    rows = [rank_row(info) for info in topo.ranks]
    for name, cells in (extra or {}).items():
        headers.append(name)
        for row, cell in zip(rows, cells):
            row.append(cell)
    return format_table(headers, rows)
