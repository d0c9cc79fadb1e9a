"""What the JE adds up over its TEs' own summaries (docs/routing.md): the EMS context cache's
counts (each TE reports its pool's in its `TeResult.summary`, xds_mpi/ems/results.py
`ems_summary`), summed, and each TE's hits."""

from __future__ import annotations

from collections.abc import Mapping

from xds_mpi.ems.results import ems_summary

EMS_KEYS = tuple(ems_summary([], []))  # every count ems_summary gives, all additive
PER_TE_KEYS = ("ems_requests_hit", "ems_tokens_skipped")


def ems_over_tes(te_summaries: Mapping[int, dict]) -> dict:
    """te -> its summary: the EMS counts summed over the TEs, and per TE k `te<k>_ems_...` of
    PER_TE_KEYS; empty when no TE reports EMS counts (ems.enabled off)."""
    reporting = {te: s for te, s in te_summaries.items() if "ems_lookups" in s}
    if not reporting:
        return {}
    out = {key: sum(s.get(key, 0) for s in reporting.values()) for key in EMS_KEYS}
    for te, s in sorted(reporting.items()):
        out.update({f"te{te}_{key}": s.get(key, 0) for key in PER_TE_KEYS})
    return out
