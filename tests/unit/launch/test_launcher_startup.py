"""The launcher counts the ranks that have loaded their code while the TE-shell cannot log yet
(launch/job/startup.py): each rank drops a mark once its imports are done."""

from __future__ import annotations

from harness import REPO_ROOT, fresh_python

from launch.cli import main as cli
from launch.job import startup
from launch.job.startup import StartupWatch


def test_the_count_is_printed_until_every_rank_has_loaded():
    lines: list[str] = []
    watch = StartupWatch(3, every_s=0.0, out=lambda line, flush: lines.append(line))
    try:
        watch.poll()
        startup.os.environ[startup.STARTUP_ENV] = str(watch.dir)
        for rank in (0, 2):
            startup.mark_loaded(rank)
        watch.poll()
        startup.mark_loaded(1)
        watch.poll()
        watch.poll()  # done: nothing more
    finally:
        del startup.os.environ[startup.STARTUP_ENV]
        watch.close()
    assert [line.split(" (")[0] for line in lines] == [
        "xds-mpi: start-up: 0 of 3 ranks have loaded their code",
        "xds-mpi: start-up: 2 of 3 ranks have loaded their code",
        "xds-mpi: start-up: all 3 ranks loaded their code in 0 s",
    ]
    assert not watch.dir.exists()


def test_a_fast_start_up_prints_nothing():
    lines: list[str] = []
    watch = StartupWatch(1, every_s=60.0, out=lambda line, flush: lines.append(line))
    startup.os.environ[startup.STARTUP_ENV] = str(watch.dir)
    try:
        startup.mark_loaded(0)
        watch.poll()
    finally:
        del startup.os.environ[startup.STARTUP_ENV]
        watch.close()
    assert lines == [] and watch.is_done


def test_every_rank_of_a_run_marks_itself(monkeypatch, capfd, tmp_path):
    counted: list[int] = []
    close = StartupWatch.close

    def count_then_close(watch):
        counted.append(watch.loaded())  # every rank's mark, whether or not a line was due
        close(watch)

    monkeypatch.setattr(StartupWatch, "close", count_then_close)
    monkeypatch.chdir(REPO_ROOT)
    code = cli.main(["run", "--set", f"run.output_dir={tmp_path}", "--set", "run.trace=false"])
    out = capfd.readouterr().out
    assert code == 0, out[-3000:]
    assert counted == [5], out[-3000:]


def test_the_launcher_does_not_start_mpi():
    """Importing mpi4py.MPI initializes MPI: in the launcher that made it an MPI singleton
    (78 ms more; with Open MPI a 16 MiB segment left in /dev/shm at every launch). The
    launcher and the plans it builds import no mpi4py.MPI; only the ranks do."""
    code = (
        "import argparse, sys\n"
        "from launch.cli.main import _load, build_parser\n"
        "build_parser()\n"
        "for config in ('colocated', 'afd', 'pd', 'ep288'):\n"
        "    _load(argparse.Namespace(config=config, set=[], np=None))\n"
        "print('mpi4py.MPI' in sys.modules)\n"
    )
    assert fresh_python(code) == "False"
