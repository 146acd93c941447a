"""indexer_topk vs a loop oracle (docs/semantics.md, decision 6; docs/packing.md).

Per query row: candidates = the compressed entries j of its own document with j < floor((p+1)/4); score =
sum_h w[t, h] ReLU(<q[t, h], k[j]>); keep the min(topk, visible) highest, best first, ties to the lower index,
-1 for empty slots; output width min(topk, max_seqlen // 4), int32 global compressed rows.
"""
from __future__ import annotations

import pytest
import torch

from dsv4attn.ops import Explicit, VisibleCompressed, indexer_topk
from dsv4attn.ops.indexer import reference as idx_ref
import dsv4attn
from tests.packs import RAGGED_R4, build_pack, cu_seqlens_of, doc_spans, wrap_chunk_rows

# One long document so some rows see many entries (and topk < visible happens), plus the ragged set.
LENGTHS = RAGGED_R4 + (37,)


def topk_oracle(q, k, w, lengths, total_rows, max_seqlen, topk, ratio=4):
    """Scalar loop, float64 scores; sort by (-score, index)."""
    width = min(topk, max_seqlen // ratio)
    out = [[-1] * width for _ in range(total_rows)]
    first_entry = 0
    for start, length in doc_spans(lengths):
        for p in range(length):
            t = start + p
            visible = min((p + 1) // ratio, length // ratio)
            scored = []
            for j in range(visible):
                e = first_entry + j
                s = sum(float(w[t, h]) * max(float(torch.dot(q[t, h].double(), k[e].double())), 0.0)
                        for h in range(q.shape[1]))
                scored.append((-s, e))
            chosen = [e for _, e in sorted(scored)[:width]]
            out[t][:len(chosen)] = chosen
        first_entry += length // ratio
    return torch.tensor(out, dtype=torch.int32).reshape(total_rows, width)


def make_inputs(seed, pack, H=3, Di=8, dtype=torch.float64):
    torch.manual_seed(seed)
    lay = pack.compressed(4)
    q = torch.randn(pack.total_rows, H, Di, dtype=torch.float64).to(dtype)
    k = torch.randn(lay.capacity, Di, dtype=torch.float64).to(dtype)
    w = torch.randn(pack.total_rows, H, dtype=torch.float64).to(dtype)
    return q, k, w, lay


@pytest.mark.parametrize("topk", [1, 3, 5, 9, 100], ids=lambda k: f"topk{k}")
@pytest.mark.parametrize("padding", [0, 6], ids=["no-pad", "pad6"])
def test_topk_vs_loop_oracle(topk, padding):
    pack = build_pack(LENGTHS, padding)
    q, k, w, lay = make_inputs(0, pack)
    got = indexer_topk(q, k, w, lay, topk)
    want = topk_oracle(q, k, w, LENGTHS, pack.total_rows, pack.max_seqlen, topk)
    assert got.dtype == torch.int32
    assert got.shape == (pack.total_rows, min(topk, pack.max_seqlen // 4))
    assert torch.equal(got, want), (got != want).nonzero()[:5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_low_precision_inputs_vs_loop_oracle(dtype):
    """Scores in fp32; with few heads and distinct random scores the selection equals the float64 oracle's."""
    pack = build_pack(LENGTHS, 3)
    q, k, w, lay = make_inputs(1, pack, dtype=dtype)
    got = indexer_topk(q, k, w, lay, 4)
    want = topk_oracle(q, k, w, LENGTHS, pack.total_rows, pack.max_seqlen, 4)
    assert torch.equal(got, want)


def test_selection_stays_in_own_document_and_visible():
    pack = build_pack(LENGTHS, 5)
    q, k, w, lay = make_inputs(2, pack)
    got = indexer_topk(q, k, w, lay, 6)
    entry_doc, entry_index = lay.entry_doc.tolist(), lay.entry_index.tolist()
    doc, pos, real, visible = (pack.row_doc.tolist(), pack.row_position.tolist(), pack.row_is_real.tolist(),
                               lay.row_visible.tolist())
    for t, row in enumerate(got.tolist()):
        chosen = [e for e in row if e >= 0]
        assert row[:len(chosen)] == chosen, f"row {t}: -1 only at the end, got {row}"
        assert len(chosen) == len(set(chosen)) == (min(6, visible[t]) if real[t] else 0), f"row {t}: {row}"
        for e in chosen:
            assert entry_doc[e] == doc[t] and entry_index[e] < (pos[t] + 1) // 4, f"row {t} selected entry {e}"


def test_other_documents_do_not_influence():
    """Changing every key and query of other documents leaves a document's selections unchanged."""
    pack = build_pack(LENGTHS, 2)
    q, k, w, lay = make_inputs(3, pack)
    base = indexer_topk(q, k, w, lay, 3)
    cu_comp = lay.cu_compressed.tolist()
    for b, (start, length) in enumerate(doc_spans(LENGTHS)):
        k2, q2 = k.clone(), q.clone()
        others = torch.ones(k.shape[0], dtype=torch.bool)
        others[cu_comp[b]:cu_comp[b + 1]] = False
        k2[others] = 10.0 * torch.randn_like(k2[others])
        q2[:start] = torch.randn_like(q2[:start])
        q2[start + length:] = torch.randn_like(q2[start + length:])
        moved = indexer_topk(q2, k2, w, lay, 3)
        assert torch.equal(moved[start:start + length], base[start:start + length]), f"doc {b}"


def test_exact_ties_all_zero_scores_lower_index_first():
    """All dot products negative: ReLU makes every score exactly 0, so the lowest visible indices win."""
    torch.manual_seed(9)
    pack = build_pack(LENGTHS, 4)
    lay = pack.compressed(4)
    q = torch.ones(pack.total_rows, 2, 4, dtype=torch.float32)
    k = -torch.rand(lay.capacity, 4, dtype=torch.float32) - 0.1
    w = torch.rand(pack.total_rows, 2)
    topk = 3
    got = indexer_topk(q, k, w, lay, topk)
    first, visible = lay.row_first_entry.tolist(), lay.row_visible.tolist()
    for t in range(pack.total_rows):
        n = min(topk, visible[t])
        expected = [first[t] + j for j in range(n)] + [-1] * (got.shape[1] - n)
        assert got[t].tolist() == expected, f"row {t}"


def test_exact_ties_between_equal_positive_scores():
    """Integer-valued q, k and power-of-two weights make scores exact; keys repeat with period 3 so equal scores
    are common: every tie must be broken by the lower index (the oracle sorts by (-score, index))."""
    pack = build_pack(LENGTHS, 4)
    lay = pack.compressed(4)
    torch.manual_seed(4)
    patterns = torch.randint(-2, 3, (3, 4)).float()
    k = patterns[torch.arange(lay.capacity) % 3]
    q = torch.randint(-2, 3, (pack.total_rows, 2, 4)).float()
    w = 2.0 ** torch.randint(-2, 2, (pack.total_rows, 2)).float()
    for topk in (2, 5):
        got = indexer_topk(q, k, w, lay, topk)
        want = topk_oracle(q, k, w, LENGTHS, pack.total_rows, pack.max_seqlen, topk)
        assert torch.equal(got, want), f"topk {topk}: {(got != want).nonzero()[:5]}"


def test_chunking_invariance(monkeypatch):
    pack = build_pack(LENGTHS, 5)
    q, k, w, lay = make_inputs(5, pack, dtype=torch.float32)
    whole = indexer_topk(q, k, w, lay, 4)
    chunks = wrap_chunk_rows(idx_ref, monkeypatch, budget=1)
    one_row = indexer_topk(q, k, w, lay, 4)
    assert len(chunks) == pack.total_rows
    assert torch.equal(whole, one_row)


def test_index_set_candidates():
    """An explicit candidate IndexSet (increasing order) selects like the layout; VisibleCompressed is the same."""
    pack = build_pack(LENGTHS, 3)
    q, k, w, lay = make_inputs(6, pack)
    by_layout = indexer_topk(q, k, w, lay, 4)
    visible = VisibleCompressed(lay, pack.total_rows)
    assert torch.equal(indexer_topk(q, k, w, visible, 4), by_layout)
    assert torch.equal(indexer_topk(q, k, w, Explicit(visible.materialize()), 4), by_layout)


def test_deterministic():
    pack = build_pack(LENGTHS, 3)
    q, k, w, lay = make_inputs(7, pack, dtype=torch.float32)
    assert torch.equal(indexer_topk(q, k, w, lay, 5), indexer_topk(q, k, w, lay, 5))


@pytest.mark.parametrize("topk", [0, -1, 2.0, True], ids=["zero", "negative", "float", "bool"])
def test_rejects_bad_topk(topk):
    pack = build_pack(LENGTHS)
    q, k, w, lay = make_inputs(8, pack)
    with pytest.raises(ValueError, match="topk"):
        indexer_topk(q, k, w, lay, topk)


def test_no_compressed_entry_with_static_max_seqlen():
    """max_seqlen is only a bound (>= the longest document): with max_seqlen 8 but a 3-row batch the layout has
    capacity 0 and width min(8, 3) // 4 = 0 (no document is longer than the batch; the width was max_seqlen // 4
    = 2, all -1); a width-0 layout and an empty k give an empty selection. With a 7-row batch: capacity 1 and
    width 1, and the slot of every row that sees no entry is -1."""
    torch.manual_seed(10)
    pack = dsv4attn.pack_batch(cu_seqlens_of((3,)), 3, 8)
    lay = pack.compressed(4)
    assert lay.capacity == 0 and lay.max_per_doc == 0
    got = indexer_topk(torch.randn(3, 2, 4), torch.randn(0, 4), torch.randn(3, 2), lay, 4)
    assert got.shape == (3, 0) and got.dtype == torch.int32
    pack = dsv4attn.pack_batch(cu_seqlens_of((3,)), 7, 8)
    lay = pack.compressed(4)
    assert lay.capacity == 1 and lay.max_per_doc == 1
    got = indexer_topk(torch.randn(7, 2, 4), torch.randn(1, 4), torch.randn(7, 2), lay, 4)
    assert torch.equal(got, torch.full((7, 1), -1, dtype=torch.int32))


def test_return_scores_must_be_a_bool():
    import dsv4attn
    from dsv4attn.ops import indexer_topk
    pack = dsv4attn.pack_batch(torch.tensor([0, 16], dtype=torch.int32), 16)
    q, k, w = torch.randn(16, 2, 4), torch.randn(4, 4), torch.randn(16, 2)
    with pytest.raises(ValueError, match="return_scores must be a bool, got 'yes'"):
        indexer_topk(q, k, w, pack.compressed(4), 2, return_scores="yes")
