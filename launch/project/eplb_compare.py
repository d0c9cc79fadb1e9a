"""`python -m launch.project.eplb_compare CONFIG BASE.h5 EPLB.h5`: a collect-only run and an EPLB
run of CONFIG compared over the same time slices (xds_mpi/projection/eplb_ab.py)."""

from __future__ import annotations

import argparse

from xds_mpi.config.paths import resolve_config
from xds_mpi.config.schema import load_config
from xds_mpi.eplb.report import SCALED_BATCH
from xds_mpi.plan.deployment import DeploymentPlan
from xds_mpi.projection.eplb_ab import compare_run_files, format_comparison
from xds_mpi.projection.moe_time import MoePricing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.project.eplb_compare", description=__doc__)
    p.add_argument("config", help="the config both runs used (YAML file or name in configs/)")
    p.add_argument("baseline", help="run file of the run with eplb.policy=none")
    p.add_argument("eplb", help="run file of the run with EPLB")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args(argv)

    cfg = load_config(resolve_config(args.config), args.set)
    topo = DeploymentPlan.build(cfg).topo
    num_routed_dies = sum(1 for r in topo.ranks if any(s.kind == "routed" for s in r.expert_slots))
    pricing = MoePricing.from_config(cfg, num_routed_dies)
    target = SCALED_BATCH * (1 + cfg.scheduler.mtp_depth) * cfg.model.top_k
    slices, num_iterations, sides = compare_run_files(args.baseline, args.eplb, pricing, target)
    print("\n".join(format_comparison(slices, num_iterations, sides)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
