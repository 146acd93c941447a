"""dsv4attn.parallel.comm: a collective that a peer never joins ends with an error naming the layer's collective
and the likely cause (the 2-rank case runs in test_context_parallel.py); other errors pass through unchanged."""
from __future__ import annotations

import pytest

from dsv4attn.parallel import comm


@pytest.mark.parametrize("backend_text", ["[../gloo/transport/tcp/pair.cc:534] Connection closed by peer",
                                          "Timed out waiting 5000ms for recv operation to complete"])
def test_a_lost_peer_is_named_with_the_collective_and_the_backend_text(backend_text):
    with pytest.raises(RuntimeError) as err:
        with comm.awaited(1, "backward all-reduce (gathered rows' gradients)"):
            raise RuntimeError(backend_text)
    text = str(err.value)
    assert text.startswith("context parallelism: rank 1 of cp_group waited in vain for the other ranks in a "
                           "layer's backward all-reduce")
    assert text.endswith(f"Backend error: {backend_text}") and isinstance(err.value.__cause__, RuntimeError)


def test_other_errors_pass_through_unchanged():
    original = RuntimeError("shape mismatch in a layer's own code")
    with pytest.raises(RuntimeError) as err:
        with comm.awaited(0, "all-gather"):
            raise original
    assert err.value is original
