"""Message tags: one registry (ranks/core/tags.py), no value used twice, none defined elsewhere (two
features once shared tag 231, and the trace gather received an EPLB count slice)."""

from __future__ import annotations

import re

from harness import REPO_ROOT

from ranks.core.tags import all_tags

DEFINITION = re.compile(r"^\s*(TAG_\w+(?:\s*,\s*TAG_\w+)*)\s*=\s*\d", re.M)


def test_every_tag_value_is_distinct():
    tags = all_tags()
    assert len(tags) >= 9
    assert len(set(tags.values())) == len(tags), tags


def test_no_module_defines_its_own_tag():
    sources = [
        p
        for folder in ("xccl", "xds_mpi", "ranks", "launch")
        for p in (REPO_ROOT / folder).rglob("*.py")
        if p != REPO_ROOT / "ranks" / "core" / "tags.py"
    ]
    found = {str(p.relative_to(REPO_ROOT)): DEFINITION.findall(p.read_text()) for p in sources}
    assert {p: names for p, names in found.items() if names} == {}
