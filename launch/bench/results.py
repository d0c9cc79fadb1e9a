"""Print a benchmark's table and write it to CSV or HDF5."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

from launch.report.tables import format_table


def add_row_options(p: argparse.ArgumentParser) -> None:
    """The CLI options `bench ep` and `bench afd` share: the rows moved, the rounds timed, the
    projection profile, the output file and the job's timeout."""
    p.add_argument("--hidden", type=int, default=7168, help="row width (default 7168)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--experts", type=int, default=256, help="routed experts (default 256)")
    p.add_argument("--int8", action="store_true", help="INT8 + per-token scale on the wire")
    p.add_argument("--iters", type=int, default=20, help="timed rounds (default 20)")
    p.add_argument("--profile", default="ascend910c", help="hardware profile for the projection")
    p.add_argument("--out", default="", help="write the table to FILE.csv or FILE.h5")
    p.add_argument("--timeout", type=float, default=900, help="seconds before the job is killed")


def rank_parser(prog: str) -> argparse.ArgumentParser:
    """The per-rank program's parser for those options (the CLI passes every one)."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--tokens", type=int, nargs="+", required=True)
    for name in ("--hidden", "--topk", "--experts", "--iters"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--int8", action="store_true")
    parser.add_argument("--profile", required=True)
    parser.add_argument("--out", default="")
    return parser


def _fmt(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, np.integer)):
        return str(value)
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def report(
    rows: list[dict], columns: list[str], args: argparse.Namespace, *, title: str, legend: str
) -> None:
    print(f"\n{title}, profile {args.profile}")
    print(format_table(columns, [[_fmt(row[c]) for c in columns] for row in rows]))
    print(legend)
    if args.out:
        write(rows, columns, Path(args.out), args)
        print(f"wrote {args.out}")


def write(rows: list[dict], columns: list[str], path: Path, args: argparse.Namespace) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix in (".h5", ".hdf5"):
        import h5py  # here: a measured start-up cost of every bench rank

        with h5py.File(path, "w") as f:
            for c in columns:
                f.create_dataset(c, data=np.array([row[c] for row in rows]))
            for key, value in vars(args).items():
                f.attrs[key] = str(value)
    else:
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
