"""Device work given to the profiler ranges it ran in, by time stamp.

The profiler links a kernel to the call that launched it only for launches it sees (the CUDA
runtime API); launches through the driver API, as Triton's are, come without a link, and a node's
``device_time_total`` would miss them. The profile therefore closes each node's range with a device
synchronisation, so the node's device work runs inside the range's span, and gives every piece of
device work (kernels, copies, sets) to the innermost range that holds its midpoint. Host and device
events share the profiler's clock (Kineto aligns them); :func:`attribute_device_work` also says how
much work fell in no range, which a misaligned clock would show as most of it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Attribution", "attribute_device_work"]


@dataclass(frozen=True)
class Attribution:
    """Device time per range instance, and what no range holds.

    Attributes:
        per_label: label -> device time (µs) of each of its range instances, in start order.
        outside_us: device time whose midpoint fell in no range (the step's own work, or a clock offset).
        total_us: all device time seen.
    """

    per_label: dict[str, list[float]]
    outside_us: float
    total_us: float

    @property
    def inside_share(self) -> float:
        """The share of device time given to some range (1.0 when there was none)."""
        return 1.0 - self.outside_us / self.total_us if self.total_us > 0 else 1.0


def attribute_device_work(
    ranges: Sequence[tuple[float, float, str]], work: Sequence[tuple[float, float]]
) -> Attribution:
    """Give each work item ``(start, end)`` to the innermost range ``(start, end, label)`` holding its midpoint.

    Ranges may nest (the latest-starting one that is still open wins); times are µs on one clock.
    One sweep over range starts and work midpoints: O((ranges + work) log).
    """
    order = sorted(range(len(ranges)), key=lambda i: (ranges[i][0], -ranges[i][1]))
    totals = [0.0] * len(ranges)
    open_ranges: list[tuple[float, int]] = []  # heap of (-start position in order, range index): innermost first
    outside = total = 0.0
    next_range = 0
    for begin, end in sorted(work, key=lambda w: w[0] + w[1]):
        mid = (begin + end) / 2
        total += end - begin
        while next_range < len(order) and ranges[order[next_range]][0] <= mid:
            heapq.heappush(open_ranges, (-next_range, order[next_range]))
            next_range += 1
        while open_ranges and ranges[open_ranges[0][1]][1] < mid:  # the innermost has ended: the next outer one
            heapq.heappop(open_ranges)
        if open_ranges:
            totals[open_ranges[0][1]] += end - begin
        else:
            outside += end - begin
    per_label: dict[str, list[float]] = {}
    for i in order:
        per_label.setdefault(ranges[i][2], []).append(totals[i])
    return Attribution(per_label, outside, total)
