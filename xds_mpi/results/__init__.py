"""What a serving run produced: per-request records and the summary, each request's projected
TTFT and TPOT, SLOs and goodput, the dies' summed reports, and the injected failures' records."""
