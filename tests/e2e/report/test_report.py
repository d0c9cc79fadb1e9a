"""`xds-mpi report`: the figures' data checked against the run file, the HTML self-contained, and
the page opened in headless Chromium, whose screenshot must show it with its images decoded."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from harness import REPO_ROOT

from launch.report.run_page import write_report
from xds_mpi.report.data import BREAKDOWN, load_run
from xds_mpi.report.plots import FIGURES
from xds_mpi.report.runfile import read_run_file

XDS_MPI = Path(sys.executable).parent / "xds-mpi"
CHROMIUM = Path("/usr/bin/chromium")  # Debian's package; .ci/run installs it
NO_CHROMIUM = "headless Chromium (Debian package `chromium`) is not installed"


def run_job(out: Path, name: str, *sets: str) -> Path:
    args = [str(XDS_MPI), "run", "colocated", "--set", f"run.output_dir={out}"]
    for text in (f"run.name={name}", "deployment.dp_groups_per_domain=2", *sets):
        args += ["--set", text]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out / f"{name}.h5"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """A traced MTP run, and one without MTP or trace to compare it with."""
    out = tmp_path_factory.mktemp("report")
    small = ("workload.num_requests=4", "workload.output_len=8")
    traced = run_job(out, "traced", "scheduler.mtp_depth=1", *small)
    plain = run_job(out, "plain", "run.trace=false", *small)
    return traced, plain


def test_the_breakdown_and_expert_load_agree_with_the_run_file(runs):
    traced, plain = runs
    run = load_run(traced)
    with h5py.File(traced) as f:
        vtime = np.array([f["dies"][r]["vtime_s"][()] for r in f["dies"]])  # [dies, iterations]
        rows = sum(f["dies"][r]["num_rows"][()].sum() for r in f["dies"])
    total = sum(run.breakdown[p] for p in (*BREAKDOWN, "other"))
    assert total == pytest.approx(vtime.mean(axis=0) * 1e3, rel=1e-6, abs=1e-6)
    model = read_run_file(traced).config.model
    main_layers = [i for i, layer in enumerate(run.load_layers) if layer < model.num_layers]
    # Every row of a main MoE layer goes to top_k routed experts, on some die.
    assert run.expert_load[main_layers].sum(axis=1).tolist() == [rows * model.top_k] * len(
        main_layers
    )
    assert not load_run(plain).has_trace and load_run(plain).expert_load is None


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory) -> Path:
    traced, plain = runs
    return write_report([traced, plain], tmp_path_factory.mktemp("out"))


def test_the_report_holds_every_figure_of_both_runs_inline(report):
    pngs = sorted(report.parent.glob("*.png"))
    assert len(pngs) == 2 * len(FIGURES)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    page = report.read_text()
    sources = re.findall(r"src='([^']*)'", page)
    assert len(sources) == 2 * len(FIGURES)
    assert all(s.startswith("data:image/png;base64,") for s in sources)
    assert "http://" not in page and "https://" not in page  # nothing fetched
    assert "traced" in page and "plain" in page and "tokens_per_s" in page


def chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [
                str(CHROMIUM),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@pytest.mark.skipif(not CHROMIUM.exists(), reason=NO_CHROMIUM)
def test_chromium_shows_the_page_with_its_images_decoded(report, tmp_path):
    import matplotlib.image

    dom = chromium("--dump-dom", report.as_uri())
    decoded = re.search(r"images decoded: (\d+)/(\d+)", dom.stdout)
    assert decoded, dom.stdout[-2000:] + dom.stderr[-2000:]
    assert decoded.group(1) == decoded.group(2) == str(2 * len(FIGURES))
    shot = tmp_path / "page.png"
    result = chromium(f"--screenshot={shot}", "--window-size=1400,3000", report.as_uri())
    assert shot.exists(), result.stderr[-2000:]
    pixels = matplotlib.image.imread(shot)[..., :3]  # [3000, 1400, 3] in [0, 1]
    assert pixels.shape[:2] == (3000, 1400)
    not_white = (pixels < 0.95).any(axis=-1)
    # Not blank, images shown: a page whose images fail to decode measured 0.008, 0.0001 and
    # 363 colours here; with its figures 0.12, 0.08 and ~6000.
    assert not_white.mean() > 0.05
    colourful = pixels.max(axis=-1) - pixels.min(axis=-1) > 0.3
    assert colourful.mean() > 0.01
    assert len(np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 1000


def test_the_cli_writes_the_report(runs, tmp_path):
    traced, plain = runs
    result = subprocess.run(
        [str(XDS_MPI), "report", str(traced), "--out", str(tmp_path), "--compare", str(plain)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"report: {(tmp_path / 'index.html').resolve()}"
    missing = subprocess.run(
        [str(XDS_MPI), "report", str(tmp_path / "none.h5")], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "no run file" in missing.stderr
