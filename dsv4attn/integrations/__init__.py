"""Integrations of dsv4attn with other libraries. Each lives in its own module and imports its library only there,
so ``import dsv4attn`` never needs any of them.

- :mod:`dsv4attn.integrations.transformers`: runs every ``DeepseekV4Attention`` of a Hugging Face transformers
  DeepseekV4 model through :class:`dsv4attn.HybridAttention` (packed rows, phases, indexer loss); needs the ``hf``
  extra (``pip install "dsv4attn[hf]"``).
"""
