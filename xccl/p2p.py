"""Point-to-point send / receive over per-pair ring buffers (xDeepServe §3.1, Figure 4).

The sender copies its message into the ring it owns in the receiver's window and publishes a
record (event id, chunk id, tail pointer, its virtual time, sizes) in the receiver's metadata; the
receiver copies the slots out and acknowledges in the sender's metadata. A message larger than the
ring goes in several publications: each fills at most the whole ring and waits for the ack that
frees it (flow control), chunk ids counting slots from the message's start.

A record is written body first, flushed, then its one-word doorbell (the publication number), so
a receiver never acts on a half-written record; one publication per pair is in flight at a time,
so a record is never rewritten while its receiver reads it. The ack is one atomic word: the
publication number (16 bits) and the receiver's virtual time in ns (48 bits, 78 virtual hours).

Operations queue per (direction, peer) and advance only inside `progress()`, which every handle's
`test()` / `wait()` calls, so async transfers make progress whenever the caller checks on any of
them and never busy-wait while it computes.

Restarting after an abandoned attempt (xccl/recovery.py): a pair may stop anywhere in a message:
the sender n publications in, the receiver m <= n consumed, an ack unwritten. The rule:
  1. abandon(): complete this die's outstanding RMA and fail every queued transfer (a transfer
     belongs to the attempt that started it; the caller starts it again, from its first byte);
  2. every die agrees on P >= every publication number and T >= every ring position any die has
     used on any pair (publication_state(), max over all dies: the vote);
  3. resync((P, T)): both ends of every pair continue from publication P and ring position T (the
     receiver's expected tail equals the sender's), and the sender rewrites its own ack words to
     "P acknowledged". The next publication, P + 1, matches no doorbell left behind (all <= P),
     no stale ack (a 16-bit number compared modulo 2^16) can retire it, and the whole ring is
     free. Nobody writes into the pair between 1 and 3: every die left the attempt, and its acks
     and records were flushed, before the vote.
Fault hooks: "p2p_send" at a message's last publication, after its bytes were Put (not yet
flushed) and before its record; "p2p_recv" when a message's last record arrived, before the copy
and the ack, so for a message of several ring fills the pair stops mid-message. A fault raised
inside `progress()` leaves the whole object failed (every later `progress()` raises it again)
until abandon(), so no later transfer of the pair reuses the slots the failed one was writing.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Generator, Sequence

import numpy as np

from xccl.errors import BufferTooSmall, EventMismatch, InjectedFault, UnknownPeer, XcclError
from xccl.faults import FaultHook, Interrupt, RecoveryHooks
from xccl.gmem import DieMemory, poll_until
from xccl.layout import DOORBELL, EVENT_ID, RECORD_WORDS, RECORDS_PER_PAIR, VTIME_NS, P2PLayout
from xccl.vclock import LinkModel, Path, VirtualClock

ACK_SEQ_BITS, ACK_TIME_BITS = 16, 48
# Publications a sender may have unacknowledged per pair: the receiver copies one out while the
# sender fills the next (each at most half the ring). A record slot is reused only after its ack.
MAX_IN_FLIGHT = RECORDS_PER_PAIR
# Below this many bytes per core a transfer is not split further (AIV cores move whole blocks).
MIN_CORE_BYTES = 4096


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """What a completed send or receive did.

    peer: the other die's rank. event_id: the caller's event id. nbytes: message size.
    num_publications: ring fills it took. vtime_ns: this die's virtual clock at completion.
    """

    peer: int
    event_id: int
    nbytes: int
    num_publications: int
    vtime_ns: float


class _Op:
    def __init__(self, kind: str, peer: int, event_id: int, nbytes: int) -> None:
        self.kind, self.peer, self.event_id, self.nbytes = kind, peer, event_id, nbytes
        self.steps: Generator[str, None, Transfer] | None = None
        self.waiting_for = "its turn on the pair"
        self.result: Transfer | None = None
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


class Handle:
    """An in-flight send or receive. `test()` advances all transfers and says if this one is done;
    `wait()` blocks (yielding the CPU) until it is, raising its error or XcclTimeout."""

    def __init__(self, p2p: "P2P", op: _Op) -> None:
        self._p2p, self._op = p2p, op

    def test(self) -> bool:
        if not self._op.done:
            self._p2p.progress()
        return self._op.done

    def wait(self, timeout_s: float | None = None) -> Transfer:
        p2p, op = self._p2p, self._op
        timeout_s = p2p.timeout_s if timeout_s is None else timeout_s
        poll_until(self.test, deadline=time.monotonic() + timeout_s, interrupt=p2p.interrupt,
                   describe=lambda: p2p.describe(op, f"no progress after {timeout_s:g} s"))
        if op.error is not None:
            raise op.error
        return op.result


class P2P:
    """send / receive between this die and the peers its layout pairs it with."""

    def __init__(self, mem: DieMemory, layout: P2PLayout, *, clock: VirtualClock | None = None,
                 link: LinkModel | None = None, num_cores: int = 2, path: Path = "mte",
                 timeout_s: float = 60.0, server_of: Sequence[int] | None = None,
                 event_base: int = 0) -> None:
        if mem.nbytes < layout.window_bytes(mem.rank):
            raise BufferTooSmall(f"rank {mem.rank}: window of {mem.nbytes} B < the "
                                 f"{layout.window_bytes(mem.rank)} B the p2p layout needs")
        mem.claim("p2p")
        self.mem, self.layout, self.me = mem, layout, mem.rank
        self.clock = clock or VirtualClock()
        self.link, self.num_cores, self.path, self.timeout_s = link, num_cores, path, timeout_s
        self.server_of = server_of
        self._body = np.zeros(RECORD_WORDS, np.uint64)
        self._published = {}        # dst -> publications sent
        self._tail = {}             # dst -> slots written (the tail pointer)
        self._link_free = {}        # dst -> virtual ns when the link to dst is free again
        self._consumed = {}         # src -> publications consumed
        self._rtail = {}            # src -> slots consumed
        self._queues: dict[tuple[str, int], deque[_Op]] = {}
        self.fault_hook: FaultHook | None = None      # (op, event_id), may raise InjectedFault
        self.interrupt: Interrupt | None = None       # every wait turn; may raise RollbackRequested
        self._fault: InjectedFault | None = None      # set by a hook, cleared by abandon()

    def set_recovery(self, hooks: RecoveryHooks) -> None:
        """Install the recovery hooks (once, by the die's recomputer; xccl/faults.py)."""
        self.interrupt, self.fault_hook = hooks.interrupt, hooks.fault_hook

    # -- API ------------------------------------------------------------------------------------
    def isend(self, data: np.ndarray, dst: int, event_id: int, *,
              num_cores: int | None = None) -> Handle:
        """Start sending `data` (any contiguous array; its bytes are sent) to `dst`.
        The caller must not change `data` until the handle completes."""
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        op = _Op("send", dst, event_id, raw.nbytes)
        self._check_pair(op, self.me, dst)
        op.steps = self._send_steps(op, raw, num_cores or self.num_cores)
        return self._enqueue(op)

    def irecv(self, out: np.ndarray, src: int, event_id: int) -> Handle:
        """Start receiving from `src` into `out` (contiguous; its first nbytes are written)."""
        raw = out.reshape(-1).view(np.uint8)
        op = _Op("recv", src, event_id, raw.nbytes)
        self._check_pair(op, src, self.me)
        op.steps = self._recv_steps(op, raw)
        return self._enqueue(op)

    def send(self, data: np.ndarray, dst: int, event_id: int, *,
             num_cores: int | None = None) -> Transfer:
        """Synchronous send: returns after the receiver acknowledged the whole message."""
        return self.isend(data, dst, event_id, num_cores=num_cores).wait()

    def recv(self, out: np.ndarray, src: int, event_id: int) -> Transfer:
        return self.irecv(out, src, event_id).wait()

    def set_clock(self, clock: VirtualClock) -> None:
        """Switch to another virtual clock (e.g. a fresh one for a measurement)."""
        self.clock = clock
        self._link_free.clear()  # times of the old clock mean nothing on the new one

    def progress(self) -> None:
        """Advance every queued transfer as far as it goes without waiting."""
        if self._fault is not None:
            raise self._fault
        for queue in self._queues.values():
            while queue:
                op = queue[0]
                try:
                    op.waiting_for = next(op.steps)
                    break  # blocked: the next op on this pair waits its turn
                except StopIteration as stop:
                    op.result = stop.value
                except InjectedFault as fault:
                    op.error = self._fault = fault
                    raise
                except XcclError as exc:
                    op.error = exc
                queue.popleft()

    def describe(self, op: _Op, what: str) -> str:
        arrow = "to" if op.kind == "send" else "from"
        waiting = f", waiting for {op.waiting_for}" if op.steps is not None else ""
        return (f"die rank {self.me}: {op.kind} of {op.nbytes} B {arrow} rank {op.peer}, event "
                f"{op.event_id}: {what}{waiting}")

    # -- recovery (the restart rule in the module docstring) -------------------------------
    def publication_state(self) -> tuple[int, int]:
        """(highest publication number, highest ring position) over this die's pairs."""
        return (max([*self._published.values(), *self._consumed.values()], default=0),
                max([*self._tail.values(), *self._rtail.values()], default=0))

    def abandon(self) -> None:
        """Complete outstanding RMA and fail every queued transfer (its handle raises)."""
        self.mem.flush_all()
        for queue in self._queues.values():
            for op in queue:
                if not op.done:
                    op.error = XcclError(self.describe(op, "abandoned by a rollback"))
        self._queues.clear()
        self._fault = None

    def resync(self, state) -> None:
        """Abandon, then continue every pair from publication P and ring position T = `state`,
        the max over all dies."""
        self.abandon()
        published, tail = (int(v) for v in state)
        have = self.publication_state()
        if published < have[0] or tail < have[1]:
            raise ValueError(f"die rank {self.me}: resync to publication {published}, ring "
                             f"position {tail} would go back from {have}")
        for src, dst in self.layout.pairs:
            if src == self.me:
                self._published[dst], self._tail[dst] = published, tail
                self.mem.store_word(self.me, self.layout.ack_offset(src, dst),
                                    (published % (1 << ACK_SEQ_BITS)) << ACK_TIME_BITS)
                self.mem.flush(self.me)
            if dst == self.me:
                self._consumed[src], self._rtail[src] = published, tail

    # -- protocol -------------------------------------------------------------------------------
    def _enqueue(self, op: _Op) -> Handle:
        self._queues.setdefault((op.kind, op.peer), deque()).append(op)
        return Handle(self, op)

    def _check_pair(self, op: _Op, src: int, dst: int) -> None:
        """Refuse an unknown peer at the call, naming both dies, the event and the size."""
        num_ranks = self.layout.num_ranks
        if not 0 <= op.peer < num_ranks:
            raise UnknownPeer(self.describe(op, f"rank {op.peer} is outside ranks "
                                                f"0..{num_ranks - 1}"))
        if (src, dst) not in self.layout.pairs:
            raise UnknownPeer(self.describe(op, f"the deployment declares no ring for rank {src} "
                                                f"-> rank {dst}"))

    def _same_server(self, peer: int) -> bool:
        return self.server_of is not None and self.server_of[peer] == self.server_of[self.me]

    def _send_steps(self, op: _Op, data: np.ndarray, num_cores: int):
        mem, layout, dst, me = self.mem, self.layout, op.peer, self.me
        ring, ack = layout.ring_offset(me, dst), layout.ack_offset(me, dst)
        slot_bytes, ring_slots = layout.slot_bytes, layout.ring_slots
        max_pub_slots = max(1, ring_slots // MAX_IN_FLIGHT)
        cores_word = num_cores | (int(self.path == "dma") << 32)
        sent = chunk_id = publications = 0
        in_flight: deque[tuple[int, int]] = deque()  # (publication number, tail after it)
        acked_tail = self._tail.get(dst, 0)
        while True:
            # Flow control: at most MAX_IN_FLIGHT publications unacknowledged, slots to write into.
            while len(in_flight) == MAX_IN_FLIGHT or (
                    sent < data.nbytes and self._tail.get(dst, 0) - acked_tail == ring_slots):
                acked_tail = self._take_acks(dst, ack, in_flight, acked_tail)
                if in_flight and (len(in_flight) == MAX_IN_FLIGHT or
                                  self._tail.get(dst, 0) - acked_tail == ring_slots):
                    yield f"the ack of publication {in_flight[0][0]} (ring full)"
            tail = self._tail.get(dst, 0)
            free_slots = min(ring_slots - (tail - acked_tail), max_pub_slots)
            nbytes = min(data.nbytes - sent, free_slots * slot_bytes)
            # Step 1-2 (Fig. 4): copy from the caller's buffer into the receiver's ring slots,
            # split over `num_cores` parallel writes (one per AIV core).
            for ring_pos, msg_pos, length in layout.slot_runs(tail, nbytes):
                base = sent + msg_pos
                for lo, hi in _split(length, num_cores):
                    mem.put(dst, ring + ring_pos + lo, data[base + lo:base + hi])
            if self.fault_hook is not None and sent + nbytes >= data.nbytes:
                # The message's last publication: its bytes are on the way, its record is not.
                self.fault_hook("p2p_send", op.event_id)
            num_slots = -(-nbytes // slot_bytes)
            tail = self._tail[dst] = tail + num_slots
            seq = self._published[dst] = self._published.get(dst, 0) + 1
            # Step 3: advance the receiver's tail pointer: record body, flush, then the doorbell.
            record = layout.record_offset(me, dst, seq)
            body = self._body
            body[EVENT_ID:] = (op.event_id, chunk_id, tail, 0, data.nbytes, nbytes, cores_word)
            body.view(np.float64)[VTIME_NS] = self._stamp(dst, nbytes, num_cores)
            mem.put(dst, record + 8, body[1:])
            mem.flush(dst)
            mem.store_word(dst, record + 8 * DOORBELL, seq)
            mem.flush(dst)
            in_flight.append((seq, tail))
            sent += nbytes
            chunk_id += num_slots
            publications += 1
            if sent >= data.nbytes:
                break
        # Step 4 / 8: poll our metadata for the receiver's acks; the last one completes the send.
        while in_flight:
            acked_tail = self._take_acks(dst, ack, in_flight, acked_tail)
            if in_flight:
                yield f"the ack of publication {in_flight[-1][0]} (tail {in_flight[-1][1]})"
        return Transfer(peer=dst, event_id=op.event_id, nbytes=data.nbytes,
                        num_publications=publications, vtime_ns=self.clock.now_ns)

    def _stamp(self, dst: int, nbytes: int, num_cores: int) -> float:
        """The sender's virtual time for a publication: its clock, or later if the link is still
        busy with its previous publication to the same die (transfers on one link serialize)."""
        if self.link is None:
            return self.clock.now_ns
        stamp = max(self.clock.now_ns, self._link_free.get(dst, 0.0))
        self._link_free[dst] = stamp + self.link.serialization_ns(
            nbytes, num_cores=num_cores, path=self.path, same_server=self._same_server(dst))
        return stamp

    def _take_acks(self, dst: int, ack: int, in_flight: deque, acked_tail: int) -> int:
        """Retire acknowledged publications; returns the tail up to which the ring is free."""
        word = self.mem.load_word(ack, dst)
        acked = word >> ACK_TIME_BITS
        # Publication numbers wrap at 16 bits; with so few in flight, "acked >= seq" is exact.
        while in_flight and (acked - in_flight[0][0]) % (1 << ACK_SEQ_BITS) < 1 << 15:
            _, acked_tail = in_flight.popleft()
            if self.link is not None:
                ack_ns = float(word & ((1 << ACK_TIME_BITS) - 1))
                self.clock.arrive(ack_ns + self.link.latency_ns(same_server=self._same_server(dst)))
        return acked_tail

    def _recv_steps(self, op: _Op, out: np.ndarray):
        mem, layout, src, me = self.mem, self.layout, op.peer, self.me
        ring, ack = layout.ring_offset(src, me), layout.ack_offset(src, me)
        received = expected_chunk = publications = 0
        total = None
        while total is None or received < total:
            # Step 5 (Fig. 4): poll our metadata until the sender's next record is published.
            seq = self._consumed.get(src, 0) + 1
            record = layout.record_offset(src, me, seq)
            while mem.load_word(record + 8 * DOORBELL, src) != seq:
                yield f"record {seq} from rank {src}"
            mem.sync()
            first = record // 8
            event_id, chunk_id, tail, _, msg_bytes, nbytes, cores_word = \
                mem.words[first + EVENT_ID:first + RECORD_WORDS].tolist()
            self._check_record(op, event_id, chunk_id, expected_chunk, msg_bytes,
                               out.nbytes if total is None else None)
            total = msg_bytes
            if self.fault_hook is not None and received + nbytes >= total:
                # The last publication arrived; the sender waits for its ack.
                self.fault_hook("p2p_recv", op.event_id)
            # Step 6: copy the slots out of the managed area into the caller's buffer.
            rtail = self._rtail.get(src, 0)
            for ring_pos, msg_pos, length in layout.slot_runs(rtail, nbytes):
                at = received + msg_pos
                out[at:at + length] = mem.local[ring + ring_pos:ring + ring_pos + length]
            rtail = self._rtail[src] = rtail + -(-nbytes // layout.slot_bytes)
            if tail != rtail:
                raise XcclError(f"die rank {me}: tail pointer from rank {src} is {tail}, "
                                f"expected {rtail} (event {op.event_id})")
            self._consumed[src] = seq
            if self.link is not None:
                self.clock.arrive(float(mem.floats[first + VTIME_NS]) + self.link.transfer_ns(
                    nbytes, num_cores=cores_word & 0xFFFFFFFF,
                    path="dma" if cores_word >> 32 else "mte", same_server=self._same_server(src)))
            # Step 7: acknowledge in the sender's metadata (frees those slots for the next fill).
            ack_word = (seq % (1 << ACK_SEQ_BITS)) << ACK_TIME_BITS | \
                (int(self.clock.now_ns) & ((1 << ACK_TIME_BITS) - 1))
            mem.store_word(src, ack, ack_word)
            mem.flush(src)
            received += nbytes
            expected_chunk += -(-nbytes // layout.slot_bytes)
            publications += 1
        return Transfer(peer=src, event_id=op.event_id, nbytes=total,
                        num_publications=publications, vtime_ns=self.clock.now_ns)

    def _check_record(self, op: _Op, event_id: int, chunk_id: int, expected_chunk: int,
                      msg_bytes: int, capacity: int | None) -> None:
        me, src = self.me, op.peer
        if event_id != op.event_id:
            raise EventMismatch(f"die rank {me}: receive from rank {src} expected event "
                                f"{op.event_id}, the record carries event {event_id} "
                                f"({msg_bytes} B message)")
        if chunk_id != expected_chunk:
            raise XcclError(f"die rank {me}: chunk id {chunk_id} from rank {src}, expected "
                            f"{expected_chunk} (event {op.event_id})")
        if capacity is not None and msg_bytes > capacity:
            raise BufferTooSmall(f"die rank {me}: receive buffer of {capacity} B < the "
                                 f"{msg_bytes} B message from rank {src} (event {op.event_id})")


def _split(length: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges splitting `length` bytes into at most `parts` near-equal 8-aligned runs."""
    if length == 0:
        return []
    step = max(MIN_CORE_BYTES, (-(-length // parts) + 7) // 8 * 8)
    return [(lo, min(lo + step, length)) for lo in range(0, length, step)]
