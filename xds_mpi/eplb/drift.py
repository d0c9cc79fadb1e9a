"""How much expert loads move from one EPLB time slice to the next, measured on the trained
checkpoint (what xds_mpi/eplb/skew.py's `Skew.drift_sigma` takes instead of an assumed number).

EPLB places replicas from past slices and serves the next one (xDeepServe §4.5), so the hottest
die after EPLB depends on how far each expert's share of the traffic moves between slices. The
papers publish no such figure. Two readings of "the next slice", both on held-out text:

- same requests (the papers' benchmarks: a fixed set of requests decoding together, xDeepServe
  §7.1, CloudMatrix-Infer §5.2): `requests` windows spread over the text; slice t reads each
  request's next `window_len` tokens;
- other traffic (a workload that changes): slice t is the t-th contiguous block of the text
  (other files), read through `requests` windows.

An expert's change is log(share in slice t+1 / share in slice t). Its spread has two parts: the
drift, and the noise of reading the text through a finite number of windows. The noise is
measured inside each slice: its windows in two halves, var(log(share in half A / share in half
B)) is twice one half's noise variance, and a whole slice (twice the windows) has half a half's,
so a slice's noise variance is var(halves) / 4, and

    sigma_drift^2 = var(log ratio between slices) - 2 x var(log ratio between halves) / 4.

The pod's slices (a minute of hundreds of thousands of requests) have no window noise left.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Measured on our own trained checkpoint (xds_mpi/data/tiny.h5), not published: the drift of an
# expert's log share of the routed rows from one EPLB time slice to the next, window noise taken
# out (`measure_drift` below, 5 slices x 256 windows of 128 held-out tokens, mean
# over the 3 MoE layers; tests/unit/xds_mpi/eplb/test_eplb_drift.py recomputes both). For a
# fixed set of requests decoding on (the papers' benchmarks) the drift is within the noise;
# between blocks of other files (a workload that changes) it is large. [000] publishes none
# (Figure 11a is one slice).
DRIFT_SAME_REQUESTS = 0.004
DRIFT_OTHER_TRAFFIC = 0.56


@dataclass(frozen=True, kw_only=True)
class DriftMeasure:
    """sigma: the drift of log(expert share) per slice, the mean over the MoE layers;
    per_layer: (layer, sigma, observed between-slice sigma, within-slice noise sigma)."""

    sigma: float
    per_layer: tuple[tuple[str, float, float, float], ...]
    num_slices: int
    requests: int
    same_requests: bool
    window_len: int


def slice_drift(counts: np.ndarray) -> tuple[float, float, float]:
    """counts: [slices, 2 halves, experts] rows routed per expert -> (drift sigma, observed
    between-slice sigma, noise sigma of one slice)."""
    whole = counts.sum(1).astype(np.float64)  # [slices, experts]
    share = whole / whole.sum(1, keepdims=True)
    halves = counts.astype(np.float64) / counts.sum(2, keepdims=True)  # [slices, 2, experts]
    ok = (counts > 0).all(axis=(0, 1))  # experts every half saw
    between = np.log(share[1:, ok] / share[:-1, ok]).var()
    within = np.log(halves[:, 1, ok] / halves[:, 0, ok]).var()
    noise = within / 4  # one whole slice: half of one half's variance; a half's is within / 2
    drift = max(0.0, between - 2 * noise)
    return float(np.sqrt(drift)), float(np.sqrt(between)), float(np.sqrt(noise))


def measure_drift(
    model,
    stream,
    *,
    same_requests: bool = True,
    num_slices: int = 5,
    requests: int = 256,
    window_len: int = 128,
) -> DriftMeasure:
    """model: the torch twin (xds_mpi/train/torch_model.py); stream: [tokens] held-out token
    ids; the slices as the module docstring reads them (window_len: the checkpoint's trained
    window, 128 tokens)."""
    import torch  # start-up: torch only when measuring (docs/design.md, Layers inside xds_mpi)

    from xds_mpi.train.corpus import spread_windows
    from xds_mpi.train.forward import main_hidden
    from xds_mpi.train.stats import _moe_gates

    gates = {name: g for name, g in _moe_gates(model).items() if name.startswith("layer")}
    num_experts = model.cfg.num_routed_experts
    block = len(stream) // num_slices
    last = len(stream) - num_slices * window_len
    starts = [last * i // max(1, requests - 1) for i in range(requests)]

    def slice_windows(t: int):
        if same_requests:
            return torch.stack(
                [stream[s + t * window_len : s + (t + 1) * window_len] for s in starts]
            ).long()
        part = stream[t * block : (t + 1) * block]
        return spread_windows(part, num_windows=requests, window_len=window_len)

    counts = np.zeros((len(gates), num_slices, 2, num_experts), np.int64)
    cell: dict[str, int] = {}  # where the hooks count: slice and half being read

    def hook(layer_idx: int):
        def count(module, inputs, routing) -> None:
            idx = routing[0].flatten()
            counts[layer_idx, cell["slice"], cell["half"]] += np.bincount(
                idx.numpy(), minlength=num_experts
            )

        return count

    handles = [g.register_forward_hook(hook(i)) for i, g in enumerate(gates.values())]
    try:
        with torch.no_grad():
            for t in range(num_slices):
                windows = slice_windows(t)
                cell["slice"] = t
                for half, rows in enumerate((windows[0::2], windows[1::2])):
                    cell["half"] = half
                    main_hidden(model, rows)
    finally:
        for handle in handles:
            handle.remove()
    per_layer = tuple((name, *slice_drift(c)) for name, c in zip(gates, counts, strict=True))
    return DriftMeasure(
        sigma=float(np.mean([s for _, s, _, _ in per_layer])),
        per_layer=per_layer,
        num_slices=num_slices,
        requests=requests,
        same_requests=same_requests,
        window_len=window_len,
    )
