"""Virtual time of p2p transfers (xccl/p2p.py): when a publication leaves, lands, is acknowledged.

Publications on one link serialize: a sender stamps each with its clock or, if the link to that
die is still busy with its previous publication, the time the link frees. A receiver's clock
moves to the stamp plus the transfer of the bytes the way the sender wrote them (AIV cores, MTE
or DMA); a sender's, to the receiver's ack time plus a one-word write. Without a link model the
stamps are the sender's clock and arrivals leave the clocks alone (the caller prices transfers).
"""

from __future__ import annotations

from collections.abc import Sequence

from xccl.vclock import LinkModel, Path, VirtualClock


class P2PTimes:
    def __init__(
        self,
        me: int,
        clock: VirtualClock,
        link: LinkModel | None,
        path: Path,
        server_of: Sequence[int] | None,
    ) -> None:
        self.me, self.clock, self.link, self.path, self.server_of = me, clock, link, path, server_of
        self._link_free: dict[int, float] = {}  # dst -> virtual ns when the link is free again

    def set_clock(self, clock: VirtualClock) -> None:
        self.clock = clock
        self._link_free.clear()  # times of the old clock mean nothing on the new one

    def stamp(self, dst: int, nbytes: int, num_cores: int) -> float:
        """The sender's virtual time for a publication of `nbytes` to `dst`."""
        if self.link is None:
            return self.clock.now_ns
        stamp = max(self.clock.now_ns, self._link_free.get(dst, 0.0))
        self._link_free[dst] = stamp + self.link.serialization_ns(
            nbytes, num_cores=num_cores, path=self.path, same_server=self._same_server(dst)
        )
        return stamp

    def publication_lands(
        self, src: int, stamp_ns: float, nbytes: int, *, num_cores: int, is_dma: bool
    ) -> None:
        if self.link is not None:
            self.clock.arrive(
                stamp_ns
                + self.link.transfer_ns(
                    nbytes,
                    num_cores=num_cores,
                    path="dma" if is_dma else "mte",
                    same_server=self._same_server(src),
                )
            )

    def ack_lands(self, dst: int, ack_ns: float) -> None:
        if self.link is not None:
            self.clock.arrive(ack_ns + self.link.latency_ns(same_server=self._same_server(dst)))

    def _same_server(self, peer: int) -> bool:
        return self.server_of is not None and self.server_of[peer] == self.server_of[self.me]
