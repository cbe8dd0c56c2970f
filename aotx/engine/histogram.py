"""The scheduler's latency histograms, exported by the gateway's ``/metrics``."""

from __future__ import annotations


class Histogram:
    """A fixed-bucket histogram (seconds), cheap enough to update per token."""

    BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

    def __init__(self) -> None:
        self.counts = [0] * (len(self.BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        i = 0
        while i < len(self.BUCKETS) and seconds > self.BUCKETS[i]:
            i += 1
        self.counts[i] += 1
        self.sum += seconds
        self.count += 1

    def snapshot(self) -> dict[str, object]:
        return {"buckets": list(self.BUCKETS), "counts": list(self.counts), "sum": self.sum,
                "count": self.count}
