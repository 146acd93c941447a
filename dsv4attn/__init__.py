"""dsv4attn: DeepSeek-V4 hybrid attention (window-only, CSA, HCA) for training on packed batches."""
from . import ops, parallel
from .backend import set_backend, set_kernels
from .checks import set_checks
from .config import AttentionConfig
from .layers import Compressor, HybridAttention, Indexer
from .packing import PackedBatch, pack_batch

__version__ = "0.1.0"

__all__ = ["AttentionConfig", "HybridAttention", "Compressor", "Indexer", "PackedBatch", "pack_batch", "ops",
           "set_backend", "set_kernels", "set_checks", "parallel", "__version__"]
