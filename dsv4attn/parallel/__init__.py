"""Context parallelism over a caller-provided torch.distributed process group (decision 10).

``x_local = shard(x, group)``; ``y_local = layer(x_local, cu_seqlens=global_cu, max_seqlen=m, cp_group=group)``;
``y = unshard(y_local, group)``. Outputs and gradients equal the single-device run.
"""
from .comm import gather_rows, left_halo, shard, unshard
from .frame import RowFrame, owned_capacity, single_device_frame
from .setup import check_rows_per_rank, context_parallel_frame

__all__ = ["shard", "unshard", "gather_rows", "left_halo", "RowFrame", "single_device_frame",
           "context_parallel_frame", "owned_capacity", "check_rows_per_rank"]
