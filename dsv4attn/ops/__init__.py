"""Stateless, autograd-aware ops. Each dispatches (``dsv4attn.backend``) between its readable reference and,
where one exists, a fused kernel with the same signature."""
from .compressor import compress_pool
from .index_sets import Concat, Explicit, IndexSet, VisibleCompressed, Window
from .indexer import indexer_topk
from .indexer_loss import indexer_kl, indexer_kl_from_attention
from .qnorm_rope import inverse_rope, qnorm_rope, qnorm_rope_stats, rope_rotate
from .sparse_attention import sparse_attention, sparse_attention_lse

__all__ = ["sparse_attention", "sparse_attention_lse", "compress_pool", "indexer_topk", "indexer_kl",
           "indexer_kl_from_attention", "qnorm_rope", "qnorm_rope_stats", "rope_rotate", "inverse_rope", "IndexSet", "Explicit", "Window",
           "VisibleCompressed", "Concat"]
