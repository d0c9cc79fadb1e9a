"""Virtual time of p2p transfers (xccl/p2p/channel.py): when a publication leaves, lands, is
acknowledged.

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
        self._rates: dict[tuple, tuple[float, float]] = {}  # (peer, cores, path) -> _rate

    def set_clock(self, clock: VirtualClock) -> None:
        self.clock = clock
        self._link_free.clear()  # times of the old clock mean nothing on the new one

    def stamp(self, dst: int, nbytes: int, num_cores: int) -> float:
        """The sender's virtual time for a publication of `nbytes` to `dst`."""
        if self.link is None:
            return self.clock.now_ns
        stamp = max(self.clock.now_ns, self._link_free.get(dst, 0.0))
        self._link_free[dst] = stamp + nbytes / self._rate(dst, num_cores, self.path)[1]
        return stamp

    def publication_lands(
        self, src: int, stamp_ns: float, nbytes: int, *, num_cores: int, is_dma: bool
    ) -> None:
        if self.link is not None:
            latency_ns, gb_per_s = self._rate(src, num_cores, "dma" if is_dma else "mte")
            self.clock.arrive(stamp_ns + (latency_ns + nbytes / gb_per_s))

    def ack_lands(self, dst: int, ack_ns: float) -> None:
        if self.link is not None:
            self.clock.arrive(ack_ns + self._rate(dst, 1, "ack")[0])

    def _rate(self, peer: int, num_cores: int, path: str) -> tuple[float, float]:
        """(start-up ns, GB/s) of a transfer to or from `peer` ("ack": a one-word flag), worked
        out once per combination: the terms of LinkModel.transfer_ns, so the sums are the same."""
        key = (peer, num_cores, path)
        rate = self._rates.get(key)
        if rate is None:
            link, same = self.link, self._same_server(peer)
            if path == "ack":
                rate = (link.latency_ns(same_server=same), 1.0)
            else:
                rate = (
                    link.transfer_ns(0, num_cores=num_cores, path=path, same_server=same),
                    link.gb_per_s(num_cores=num_cores, path=path, same_server=same),
                )
            self._rates[key] = rate
        return rate

    def _same_server(self, peer: int) -> bool:
        return self.server_of is not None and self.server_of[peer] == self.server_of[self.me]
