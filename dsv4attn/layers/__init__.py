"""nn.Modules: thin wrappers that call ``dsv4attn.ops`` (never Triton directly)."""
from .attention import HybridAttention
from .compressor import Compressor
from .indexer import Indexer

__all__ = ["HybridAttention", "Compressor", "Indexer"]
