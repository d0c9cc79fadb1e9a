"""Every two-sided MPI message tag of the control plane, in one place so no two features share
one (a shared tag hands one feature's message to another's receive)."""

from __future__ import annotations

# Startup handshake (ranks/core/handshake.py).
TAG_HELLO, TAG_VERDICT = 101, 102
# Start-up progress: every rank but 0, once built, tells rank 0 (ranks/core/ready.py).
TAG_READY = 103
# TE-shell <-> dies (ranks/core/messages.py).
TAG_REQUEST, TAG_STOP, TAG_TOKENS, TAG_REPORT = 201, 202, 203, 205
# TE-shell -> die: drop a request and free its KV (serve: its client went away).
TAG_CANCEL = 206
# Prefill-decode disaggregation (ranks/pd/messages.py, ranks/pd/faults.py).
TAG_PD_PREFILLED, TAG_PD_TASK, TAG_PD_PULL, TAG_PD_TRANSFER = 211, 212, 213, 214
TAG_PD_ABORT, TAG_PD_ABORT_ACK = 215, 216
TAG_PD_READY, TAG_PD_DONE = 217, 218
# Virtual clock, a decode die that may be lost: the decode TE-shell's bound to the JE
# (ranks/shell/pd_pacers.py).
TAG_PD_LOSS_BOUND = 219
# Weights at scale-out (ranks/core/weights_window.py): TE-shell -> standby die, where to pull
# them from; die -> TE-shell, what it moved.
TAG_WEIGHTS_LOAD, TAG_WEIGHTS_LOADED = 221, 222
# Expert load balancing: count slices in, placements out (ranks/colocated/eplb.py,
# ranks/shell/eplb.py; the records: xds_mpi/eplb/records.py).
TAG_EPLB_COUNTS, TAG_EPLB_PLACEMENT = 231, 232
# Heartbeats, both tiers (ranks/recovery/watch.py); 253-259 decode failover, 261-269 PD
# failover.
TAG_HEARTBEAT, TAG_HEARTBEAT_ACK = 251, 252
# PD link probing and re-routing (ranks/recovery/link_probe.py, ranks/pd/channel.py,
# ranks/shell/je.py).
TAG_PD_PROBE, TAG_PD_ECHO, TAG_PD_VERDICT = 261, 262, 263
TAG_PD_CANCEL, TAG_PD_FAULT_BEGAN = 264, 265
# A prefill TE lost (ranks/recovery/je_prefill_loss.py): JE -> decode dies, their withdrawn requests
# back.
TAG_PD_PREFILL_LOST, TAG_PD_WITHDRAWN = 266, 267
# A die's KV memory fault and the requests it ended (ranks/recovery/memory.py).
TAG_MEMORY_FAULT = 268
# Decode failover (ranks/recovery/watch.py): a die tells the TE-shell when its injected fault
# began.
TAG_FAILURE_BEGAN = 253
# Vertical scaling (ranks/recovery/scale_down.py): the lost dies out to the survivors; each one's
# ready.
TAG_FAILOVER, TAG_FAILOVER_READY = 254, 255
# A PD decode die lost (ranks/recovery/decode_loss.py, ranks/recovery/je_decode_loss.py): the decode
# TE-shell tells
# the JE (and at the end hands it its detections); the JE has every prefill die withdraw the
# sends to the lost die and name the tasks it still holds.
TAG_PD_DECODE_LOST, TAG_PD_DECODE_BOOK = 269, 256
TAG_PD_DECODE_WITHDRAW, TAG_PD_DECODE_HELD = 257, 258
# EMS context cache (ranks/ems/client.py, ranks/ems/pool.py): a prefill die's puts, reads
# (for the LRU) and end of run to a pool rank, on one tag so they arrive in the order sent; the
# pool ranks' reports to the JE; a pool rank's answer to an ems.faults evict row.
TAG_EMS, TAG_EMS_REPORT, TAG_EMS_EVICTED = 271, 272, 273
# Trace events, once per rank at the end (ranks/core/trace_io.py).
TAG_TRACE = 241
# An afd expert die's measured load, once at the end (ranks/afd/load_io.py).
TAG_AFD_LOAD = 242
# Virtual-time serving (ranks/core/vtime_messages.py): TE-shell -> die, a grant (requests, the
# horizon, the warp); die -> TE-shell, where its clock stands.
TAG_VTIME_GRANT, TAG_VTIME_CLOCK = 281, 282
# a cluster's TE-shell -> its JE (ranks/cluster/messages.py)
TAG_CLUSTER_FINISHED, TAG_CLUSTER_RESULT = 291, 292
# a PD pair in a cluster: its decode TE-shell -> its JE, the decode side's state while it waits
# at the promise (ranks/cluster/pd_side.py)
TAG_PD_DECODE_STATE = 293
# Weights at scale-out (ranks/cluster/weights_load.py): JE -> a standby TE's TE-shell, the load
# order; TE-shell -> JE, its dies' loads
TAG_CLUSTER_LOAD, TAG_CLUSTER_LOADED = 294, 295
# `xds-mpi serve` on a cluster (ranks/cluster/serve_messages.py): JE -> TE-shell, the endpoint's
# requests, cancels and the shutdown, in the order taken; TE-shell -> JE, its news (tokens,
# readiness, failover, gauges)
TAG_CLUSTER_SERVE, TAG_CLUSTER_NEWS = 296, 297
# cluster.num_jes > 1 (ranks/cluster/je.py): JE j -> JE 0 at the end, what it routed
TAG_CLUSTER_SHARE = 298
# a cluster's TE-shell -> its JEs: its dies cannot go on (ranks/cluster/te_side.py `TePacer.lost`)
TAG_CLUSTER_TE_LOST = 299
# The pool of ranks (ranks/cluster/pool_rank.py, pool_shell.py): JE -> a pool TE's TE-shell on
# the link, its activation and release; JE -> a pool rank on the world, its activation and the
# stop; the members of a forming TE, their meeting and Comm.Create_group
TAG_CLUSTER_POOL, TAG_POOL_RANK, TAG_POOL_GROUP = 311, 312, 313


def all_tags() -> dict[str, int]:
    return {k: v for k, v in globals().items() if k.startswith("TAG_")}
