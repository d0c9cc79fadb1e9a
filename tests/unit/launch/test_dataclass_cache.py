"""The launcher's cache of the dataclass methods every rank would compile
(launch/job/dataclass_cache.py writes it, xds_mpi/config/dataclass_cache.py reads it): a rank
given it compiles none of the project's, its classes behave as compiled ones, and a class the
cache does not hold, or a cache that cannot be read, is compiled as before."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from harness import REPO_ROOT

from launch.job import dataclass_cache
from xds_mpi.config.dataclass_cache import CachedExec, release, use_cache

# A rank's imports, the cache (PATH or none) turned on first as launch/job/rank.py does, then what a
# die's constructor imports and what a rank's config looks like through the cached methods.
RANK = """
import collections, dataclasses, json, sys
from xds_mpi.config import dataclass_cache
cached = dataclass_cache.use_cache(dataclass_cache.Path(sys.argv[1])) if sys.argv[1] else None
import launch.job.rank, ranks.colocated.die, ranks.shell.te_shell, xccl.ep.buffer
from xds_mpi.config.schema import load_config
cfg = load_config("configs/colocated.yaml", ["deployment.dp_groups_per_domain=3"])
other = load_config("configs/colocated.yaml")
try:
    cfg.run.seed = 1
    frozen = False
except dataclasses.FrozenInstanceError:
    frozen = True
print(json.dumps({
    "hits": cached.hits if cached else 0,
    "missed": sorted(collections.Counter(cached.missed).items()) if cached else None,
    "repr": repr(cfg), "eq": [cfg == other, cfg == load_config("configs/colocated.yaml",
    ["deployment.dp_groups_per_domain=3"])], "hash": hash(cfg.run) == hash(other.run),
    "frozen": frozen,
}))
"""


def rank_imports(cache: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", RANK, cache],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=True,
    )
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def cache_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("dataclasses") / "cache.marshal"
    subprocess.run(
        [sys.executable, "-m", "launch.job.dataclass_cache", str(path)], cwd=REPO_ROOT, check=True
    )
    return path


def test_a_rank_given_the_cache_compiles_none_of_the_project_dataclasses(cache_file):
    got = rank_imports(str(cache_file))
    assert got["missed"] == [], f"compiled in the rank, not found in the cache: {got['missed']}"
    assert got["hits"] > 300  # ~80 classes of a die and the TE-shell, ~5 methods each


def test_the_cached_methods_behave_as_compiled_ones(cache_file):
    with_cache, without = rank_imports(str(cache_file)), rank_imports("")
    assert without["hits"] == 0 and without["missed"] is None
    for key in ("repr", "eq", "hash", "frozen"):
        assert with_cache[key] == without[key], key
    assert with_cache["eq"] == [False, True] and with_cache["frozen"] is True


@pytest.fixture
def restore_exec():
    """The test's own cache, whatever an earlier import left on (importing the rank entry turns
    one on for the whole process); the process's state put back after."""
    before = vars(dataclasses).get("exec")
    if before is not None:
        del dataclasses.exec
    yield
    if "exec" in vars(dataclasses):
        del dataclasses.exec
    if before is not None:
        dataclasses.exec = before


def test_a_class_the_cache_does_not_hold_is_compiled(tmp_path, restore_exec):
    path = tmp_path / "cache.marshal"
    subprocess.run(
        [sys.executable, "-m", "launch.job.dataclass_cache", str(path)], cwd=REPO_ROOT, check=True
    )
    cached = use_cache(path)
    assert isinstance(cached, CachedExec)

    @dataclasses.dataclass(frozen=True)
    class NotInTheCache:
        answer_for_this_test_only: int = 42

    assert cached.missed == [__name__] * len(cached.missed) and len(cached.missed) >= 4
    assert NotInTheCache().answer_for_this_test_only == 42
    assert NotInTheCache(1) != NotInTheCache(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        NotInTheCache().answer_for_this_test_only = 0


@pytest.mark.parametrize("content", [b"", b"not marshal", b"\xe9\x00\x00\x00"])
def test_a_cache_that_cannot_be_read_changes_nothing(tmp_path, content, restore_exec):
    path = tmp_path / "cache.marshal"
    path.write_bytes(content)
    assert use_cache(path) is None
    assert use_cache(tmp_path / "missing.marshal") is None
    assert "exec" not in vars(dataclasses)


def test_a_source_newer_than_the_cache_makes_it_stale(tmp_path):
    path = tmp_path / "cache.marshal"
    assert dataclass_cache.stale(path)  # none yet
    path.write_bytes(b"")
    newest = max((REPO_ROOT / "xccl").rglob("*.py"), key=lambda p: p.stat().st_mtime)
    os.utime(path, (newest.stat().st_mtime + 10,) * 2)
    assert not dataclass_cache.stale(path, ("xccl",))
    os.utime(path, (newest.stat().st_mtime - 10,) * 2)
    assert dataclass_cache.stale(path, ("xccl",))


def test_release_ends_the_cache(cache_file, restore_exec):
    cached = use_cache(cache_file)
    assert cached is not None and cached.codes
    release()
    assert "exec" not in vars(dataclasses) and not cached.codes
    release()  # nothing to release: nothing happens
