"""Bin packing and rank balancing for the Packer (DESIGN §6).

`pack_ffd` groups sample lengths into ``seq_len`` rows (First-Fit-Decreasing); `bin_cost` estimates a
row's compute; `split_to_align` splits the heaviest rows until their count divides evenly over the
data-parallel ranks (rather than topping ranks up with filler rows); `assign_to_ranks` spreads rows
over ranks (longest-processing-time greedy).
"""

import heapq
from collections.abc import Sequence

__all__ = ["assign_to_ranks", "bin_cost", "pack_ffd", "split_to_align"]


def pack_ffd(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """First-Fit-Decreasing bin packing: indices of ``lengths`` grouped into bins of capacity ``seq_len``.

    Items are taken longest first (ties in input order) and each goes into the lowest-numbered bin with
    room. Bins are returned in opening order; inside a bin, indices are in placement order.

    O(n log n): a max segment tree over bins' remaining capacities finds the first bin with room in
    O(log bins) by descending left whenever the left subtree can hold the item. Unopened bins hold full
    capacity, so "no open bin fits" naturally lands on the next new bin. First Fit leaves at most one
    bin at most half full, so there are at most ``2·⌈total/seq_len⌉ + 1`` bins (and at most n), which
    sizes the tree.
    """
    n = len(lengths)
    if seq_len < 1:
        raise ValueError(f"seq_len must be ≥ 1, got {seq_len}")
    if n == 0:
        return []
    longest, shortest = max(lengths), min(lengths)
    if longest > seq_len or shortest < 1:
        raise ValueError(f"every length must be in [1, {seq_len}]; got min {shortest}, max {longest}")
    # Python's sort is stable under reverse=True: equal lengths keep input order (deterministic output).
    order = sorted(range(n), key=lengths.__getitem__, reverse=True)
    max_bins = min(n, 2 * -(-sum(lengths) // seq_len) + 1)
    if max_bins <= LINEAR_SCAN_MAX_BINS:
        return _first_fit_scan(order, lengths, seq_len)
    leaves = 1 << (max_bins - 1).bit_length()
    tree = [seq_len] * (2 * leaves)  # tree[1] is the root; leaves at [leaves, 2·leaves)
    bins: list[list[int]] = []
    for i in order:
        size = lengths[i]
        node = 1
        while node < leaves:
            node <<= 1
            if tree[node] < size:
                node += 1
        b = node - leaves
        if b == len(bins):
            bins.append([i])
        else:
            bins[b].append(i)
        tree[node] -= size
        node >>= 1
        while node:
            left, right = tree[2 * node], tree[2 * node + 1]
            best = left if left > right else right
            if tree[node] == best:  # ancestors are unchanged too
                break
            tree[node] = best
            node >>= 1
    return bins


LINEAR_SCAN_MAX_BINS = 32
"""Up to this many bins a plain scan of the open bins beats the tree's walk (a pack of the Packer
has about ``dp_world_size`` bins); both place every item in the same bin."""


def _first_fit_scan(order: list[int], lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """`pack_ffd`'s placement by scanning the open bins' free room in order."""
    room: list[int] = []
    bins: list[list[int]] = []
    for i in order:
        size = lengths[i]
        b = 0
        while b < len(room) and room[b] < size:
            b += 1
        if b == len(room):
            room.append(seq_len - size)
            bins.append([i])
        else:
            room[b] -= size
            bins[b].append(i)
    return bins


def bin_cost(seq_lens: Sequence[int], padded_len: int, attention_cost_weight: float) -> float:
    """Relative compute of one packed row, for balancing ranks.

    ``padded_len + w · Σ len_i²``: the dense layers cost ∝ every token (padding included); block-diagonal
    attention costs ∝ Σ len_i² over the samples. For a dense transformer with hidden size d, attention
    FLOPs per layer ≈ 2·len²·d (causal) against ≈ 24·d²·len for the matmuls, so w ≈ 1 / (12·d).
    """
    return padded_len + attention_cost_weight * sum(s * s for s in seq_lens)


def assign_to_ranks(costs: Sequence[float], n_ranks: int) -> list[list[int]]:
    """Longest-processing-time greedy: indices of ``costs``, most expensive first, each to the least
    loaded rank (ties → lower rank), with at most ``⌈len(costs) / n_ranks⌉`` per rank.

    The cap keeps the pass counts even, so padding every rank to the same count needs at most
    ``n_ranks − 1`` fillers; without it LPT may give one rank a single huge row and another many small
    ones. Inside a rank, indices are in assignment order (most expensive first).
    """
    cap = max(1, -(-len(costs) // n_ranks))
    grid: list[list[int]] = [[] for _ in range(n_ranks)]
    heap = [(0.0, rank) for rank in range(n_ranks)]  # (load, rank)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        load, rank = heapq.heappop(heap)
        grid[rank].append(i)
        if len(grid[rank]) < cap:  # a full rank leaves the heap for good
            heapq.heappush(heap, (load + costs[i], rank))
    return grid


def split_to_align(
    bins: list[list[int]], lengths: Sequence[int], n_ranks: int, attention_cost_weight: float
) -> list[list[int]]:
    """Split the heaviest bins (by `bin_cost`) in two until ``len(bins)`` is a multiple of ``n_ranks``.

    A rank without a row of its own runs a filler (a pass with no loss) while the others train, and
    the step lasts as long as the heaviest row. Splitting that row instead gives the idle rank real
    work and shortens the critical path: 3 rows on 4 ranks become 4 rows and no filler; 2 rows become
    2 + 2. Samples stay whole (a bin of one sample cannot split), so fillers remain only when no bin
    with two or more samples is left. The halves are balanced by tokens (longest first, each to the
    lighter half); inside each half the indices keep the bin's order. Returns new lists; ``bins`` is
    not modified.
    """
    out = [list(b) for b in bins]

    def cost(b: list[int]) -> float:
        return bin_cost([lengths[i] for i in b], sum(lengths[i] for i in b), attention_cost_weight)

    while out and len(out) % n_ranks:
        splittable = [k for k, b in enumerate(out) if len(b) > 1]
        if not splittable:
            break
        k = max(splittable, key=lambda k: cost(out[k]))
        halves: tuple[list[int], list[int]] = ([], [])
        loads = [0, 0]
        for i in sorted(out[k], key=lambda i: -lengths[i]):
            side = 0 if loads[0] <= loads[1] else 1
            halves[side].append(i)
            loads[side] += lengths[i]
        order = {i: n for n, i in enumerate(out[k])}
        out[k : k + 1] = [sorted(h, key=order.__getitem__) for h in halves]
    return out
