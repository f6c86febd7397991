"""A gradient as (offset, values) segments that tile a shard: a push that came in parts
is applied from the parts as received, without joining them into one buffer. Pure logic.

Elementwise kernels (the optimizer step, the BSP mean) run vector blocks from the start
of the array they are given, and finish its last few values one by one, which may round
differently (fused multiply-add in the blocks, not in the tail). A segment boundary the
whole array has no tail at would change some values' last bit, so `aligned` re-cuts the
segments at multiples of ALIGN values, copying the few values around any other boundary
into a small buffer: the step in segments is then bit-for-bit the step on the whole array.
"""

import numpy as np

ALIGN = 64  # values: a multiple of every x86 and Arm vector block (and of their unrolled pairs)


def aligned(segments: list[tuple[int, np.ndarray]]) -> list[tuple[int, np.ndarray]]:
    """The values of `segments` (tiling [0, n), any order) re-cut so that every boundary
    inside is a multiple of ALIGN; the windows around the other boundaries are copies.
    None or one segment is returned as it is."""
    if len(segments) < 2:
        return segments
    segs = sorted(segments, key=lambda s: s[0])
    n = segs[-1][0] + segs[-1][1].size
    windows: list[list[int]] = []  # [start, end) around the unaligned boundaries, merged
    for lo, _ in segs[1:]:
        if lo % ALIGN:
            start = lo - lo % ALIGN
            if windows and start <= windows[-1][1]:
                windows[-1][1] = min(n, start + ALIGN)
            else:
                windows.append([start, min(n, start + ALIGN)])
    if not windows:
        return segs
    copies = np.empty(sum(end - start for start, end in windows), dtype=segs[0][1].dtype)
    # segments and windows are both sorted: each sweep below moves a cursor forward only, so
    # a push in k parts costs O(k) here, not O(k * windows)
    out, at, first = [], 0, 0
    for start, end in windows:
        window = copies[at:at + end - start]
        at += end - start
        while segs[first][0] + segs[first][1].size <= start:
            first += 1
        j = first
        while j < len(segs) and segs[j][0] < end:
            lo, values = segs[j]
            a, b = max(lo, start), min(lo + values.size, end)
            window[a - start:b - start] = values[a - lo:b - lo]
            j += 1
        out.append((start, window))
    w = 0
    for lo, values in segs:  # each segment's values outside the windows, as views
        pos, hi = lo, lo + values.size
        while w < len(windows) and windows[w][1] <= pos:
            w += 1
        k = w
        while k < len(windows) and windows[k][0] < hi:
            start, end = windows[k]
            if start > pos:
                out.append((pos, values[pos - lo:start - lo]))
            pos = max(pos, end)
            k += 1
        if pos < hi:
            out.append((pos, values[pos - lo:]))
    return sorted(out, key=lambda s: s[0])
