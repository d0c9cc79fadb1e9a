"""Print a benchmark's table and write it to CSV or HDF5."""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

from launch.report import format_table


def _fmt(value) -> str:
    if isinstance(value, (int, np.integer)):
        return str(value)
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def report(rows: list[dict], columns: list[str], args: argparse.Namespace, *, title: str,
           legend: str) -> None:
    print(f"\n{title}, profile {args.profile}")
    print(format_table(columns, [[_fmt(row[c]) for c in columns] for row in rows]))
    print(legend)
    if args.out:
        write(rows, columns, Path(args.out), args)
        print(f"wrote {args.out}")


def write(rows: list[dict], columns: list[str], path: Path, args: argparse.Namespace) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix in (".h5", ".hdf5"):
        import h5py
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
