"""Context parallelism over a caller-provided torch.distributed process group (docs/semantics.md, decision 10).

``x_local = shard(x, group, partition)``; ``pack = pack_batch(global_cu, T, m, cp_group=group,
cp_partition=partition)`` (once per batch: the ranks agree on it there); ``y_local = layer(x_local, pack=pack,
phase=...)`` for every layer (or per call: ``layer(x_local, cu_seqlens=global_cu, max_seqlen=m, cp_group=group,
cp_partition=partition)``); ``y = unshard(y_local, group, partition)``. Outputs and gradients equal
the single-device run for either partition (``"contiguous"``, ``"head_tail"``).

Tensor parallelism (:mod:`.tensor`): ``HybridAttention(cfg, ratio, tp_group=group)`` splits the query heads over
``group`` (docs/tensor_parallel.md); it composes with the CP group above.

FSDP2 (data-parallel sharding) lives in :mod:`dsv4attn.parallel.fsdp`, imported on use (it imports
``torch.distributed.fsdp``): ``shard_model``, the full-state gather and load.
"""
from .comm import gather_rows, left_halo, shard, unshard, with_left_halos
from .frame import RowFrame, Segment, owned_capacity, single_device_frame
from .partition import PARTITIONS, chunks_of_rank, num_chunks, segments
from .setup import check_rows_per_rank, context_parallel_frame, halo_rows, layer_frame, pack_frame
from .tensor import TensorParallel

__all__ = ["shard", "unshard", "gather_rows", "left_halo", "with_left_halos", "RowFrame", "Segment",
           "single_device_frame", "context_parallel_frame", "owned_capacity", "check_rows_per_rank", "PARTITIONS",
           "chunks_of_rank", "num_chunks", "segments", "halo_rows", "layer_frame", "pack_frame", "TensorParallel"]
