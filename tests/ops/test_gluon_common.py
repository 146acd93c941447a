"""The host-side half of the Gluon backward kernels' line-wide reductions (``dsv4attn.ops.gluon_common``).

``add_reduced`` stores column 16a + 8b + 2q + e of each 16-column group at 16a + 4q + 2b + e (so that a thread's
four values are adjacent); ``add_unpermuted`` must add the accumulator back in the natural order, in place.
"""
from __future__ import annotations

import torch

from dsv4attn.ops.gluon_common import add_unpermuted


def test_add_unpermuted_inverts_the_kernels_column_permutation():
    gen = torch.Generator().manual_seed(0)
    for rows, cols in ((5, 64), (3, 128), (0, 512)):
        natural = torch.randn(rows, cols, generator=gen)
        permuted = torch.empty_like(natural)
        for c in range(cols):
            a, b, q, e = c // 16, (c // 8) % 2, (c // 2) % 4, c % 2
            permuted[:, 16 * a + 4 * q + 2 * b + e] = natural[:, c]
        dst = torch.randn(rows, cols, generator=gen)
        want = dst + natural
        add_unpermuted(dst, permuted)
        assert torch.equal(dst, want)
