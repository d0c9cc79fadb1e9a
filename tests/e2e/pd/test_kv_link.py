"""Heterogeneous PD (xDeepServe §5.1): a prefill die of another hardware than the decode dies
(910B prefill, 910C decode) sends its KV over RoCE or VPC, chosen per pair
(xds_mpi/plan/kv_link.py); the p2p protocol is unchanged, only the transfer's virtual time
follows the link class."""

from __future__ import annotations

import subprocess

import h5py
import numpy as np
import pytest
from harness import REPO_ROOT
from test_serving import XDS_MPI

from launch.cli.main import main
from xds_mpi.config.paths import resolve_config
from xds_mpi.config.schema import ConfigError, load_config
from xds_mpi.model.shapes import cost_shape
from xds_mpi.plan.kv_link import kv_link_class, kv_link_model
from xds_mpi.plan.kv_memory import projected_kv_bytes
from xds_mpi.plan.topology import Topology

PREFILL, DECODE = 6, 2  # configs/pd.yaml: ranks 2-5 decode, 6-7 prefill


def _pd(*sets: str):
    cfg = load_config(resolve_config("pd"), list(sets))
    return cfg, Topology.from_config(cfg)


@pytest.mark.parametrize(
    "sets, link, gb_per_s",
    [
        ((), "ub", None),
        (("pd.prefill_profile=ascend910c",), "ub", None),  # the same hardware: one UB domain
        (("pd.prefill_profile=ascend910b",), "roce", 25),  # both ends' NICs: 200 Gb/s per die
        (("pd.prefill_profile=ascend910b", "pd.kv_fabric=vpc"), "vpc", 3.125),
    ],
)
def test_link_class_per_pair(sets, link, gb_per_s):
    cfg, topo = _pd(*sets)
    assert kv_link_class(cfg, topo, PREFILL, DECODE) == link
    model = kv_link_model(cfg, topo, PREFILL, DECODE)
    if gb_per_s is not None:
        assert model.gb_per_s(num_cores=cfg.xccl.num_cores) == gb_per_s
    # decode dies among themselves stay on UB whatever the prefill hardware
    assert kv_link_class(cfg, topo, DECODE, DECODE + 1) == "ub"


def test_long_prompt_costs_more_over_roce_and_vpc():
    """A 4K-token prompt's latent cache (61 layers + MTP, BF16: 293 MB) at the cost shape."""
    nbytes = projected_kv_bytes(4096, cost_shape())
    ms = {}
    for name, sets in (("ub", ()), ("roce", ("pd.prefill_profile=ascend910b",)),
                       ("vpc", ("pd.prefill_profile=ascend910b", "pd.kv_fabric=vpc"))):  # fmt: skip
        cfg, topo = _pd(*sets)
        link = kv_link_model(cfg, topo, PREFILL, DECODE)
        ms[name] = link.transfer_ns(nbytes, num_cores=cfg.xccl.num_cores) / 1e6
    assert ms["ub"] < ms["roce"] < ms["vpc"]
    assert ms["vpc"] == pytest.approx(nbytes / 3.125e6 + 0.020, rel=1e-6)  # bytes / rate + latency


def test_refusals(capsys):
    from xds_mpi.plan.deployment import DeploymentPlan

    cfg, _ = _pd("pd.prefill_profile=h800")  # h800.yaml has no scale_out section
    with pytest.raises(ConfigError, match=r"profile 'h800' section 'scale_out' lacks \['roce_gb"):
        DeploymentPlan.build(cfg, 8)
    assert main(["validate", "pd", "--set", "pd.prefill_profile=nosuch"]) == 2
    assert "pd.prefill_profile: hardware.profile 'nosuch': no such profile" in (
        capsys.readouterr().err
    )
    assert main(["validate", "pd", "--set", "pd.kv_fabric=ib"]) == 2
    assert "pd.kv_fabric must be one of 'roce', 'vpc'" in capsys.readouterr().err


@pytest.mark.timeout(400)
def test_910b_prefill_run(tmp_path):
    """`xds-mpi run pd --check` with 910B prefill dies: every token as the reference's, and each
    request's projected KV transfer is the RoCE link's for its prompt, not the UB's."""
    result = subprocess.run(
        [str(XDS_MPI), "run", "pd", "--check", "--set", f"run.output_dir={tmp_path}",
         "--set", "run.name=het", "--set", "run.trace=false",
         "--set", "pd.prefill_profile=ascend910b"],
        capture_output=True, text=True, timeout=380, cwd=REPO_ROOT,
    )  # fmt: skip
    assert "0 mismatches" in result.stdout, result.stdout + result.stderr
    cfg, topo = _pd("pd.prefill_profile=ascend910b")
    ub_cfg, ub_topo = _pd()
    big = cost_shape()
    with h5py.File(tmp_path / "het.h5", "r") as f:
        prompt_len = dict(zip(f["requests/req_id"][()], f["requests/prompt_len"][()], strict=True))
        pd = {k: f["pd"][k][()] for k in ("req_id", "prefill_rank", "decode_rank",
                                            "ttft_kv_transfer_v_s")}  # fmt: skip
    assert len(pd["req_id"]) == cfg.workload.num_requests
    for req, p, d, got in zip(*pd.values(), strict=True):
        nbytes = projected_kv_bytes(int(prompt_len[req]), big)
        cores = cfg.xccl.num_cores
        roce = kv_link_model(cfg, topo, int(p), int(d)).transfer_ns(nbytes, num_cores=cores)
        ub = kv_link_model(ub_cfg, ub_topo, int(p), int(d)).transfer_ns(nbytes, num_cores=cores)
        assert got == pytest.approx(roce / 1e9, rel=1e-9)
        assert roce > 1.5 * ub
    assert np.all(pd["ttft_kv_transfer_v_s"] > 0)


def test_every_910b_constant_names_its_source():
    """Each value of the 910B profile cites a seed ([00N]) or says it is an assumption."""
    lines = (REPO_ROOT / "configs/hardware/ascend910b.yaml").read_text().splitlines()
    values = [
        ln for ln in lines if ":" in ln.split("#")[0] and ln.split("#")[0].split(":")[1].strip()
    ]
    cited = [
        ln for ln in values if "#" in ln and ("[00" in ln or "assumption" in ln or "as the" in ln)
    ]
    assert values and [ln for ln in values if ln not in cited] == ["name: ascend910b"]
