"""Rollout packing for the worker pool: per-run buffers, fair selection, step accounting
(`packer`), bin packing and rank balancing (`bins`), and the packed row layout (`rows`)."""

from trainer_core.packing.bins import assign_to_ranks, bin_cost, pack_ffd, split_to_align
from trainer_core.packing.buffer import RunBuffer, SampleChunk
from trainer_core.packing.packer import InvalidSampleError, Packer, PackResult, RunPackStats
from trainer_core.packing.rows import MicroBatch, RowFormat, SampleRef

__all__ = [
    "InvalidSampleError",
    "MicroBatch",
    "PackResult",
    "Packer",
    "RowFormat",
    "RunBuffer",
    "RunPackStats",
    "SampleChunk",
    "SampleRef",
    "assign_to_ranks",
    "bin_cost",
    "pack_ffd",
    "split_to_align",
]
