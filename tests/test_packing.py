"""pack_batch / PackedBatch / CompressedLayout against plain python loops over the documents
(docs/semantics.md, decisions 3, 4, 9; docs/packing.md)."""
from __future__ import annotations

import pytest
import torch

import dsv4attn
from dsv4attn.ops import VisibleCompressed, Window
from tests.packs import cu_seqlens_of, doc_spans

# Length 1, 3 (< 4), 4 (== 4), 5 (4 + 1), 7 (not divisible), 130 (> 128, not divisible), an empty document.
LENGTHS = (1, 3, 4, 0, 5, 7, 130)
PADDINGS = [pytest.param(0, id="no-padding"), pytest.param(9, id="pad9"), pytest.param(260, id="pad260")]


def loop_rows(lengths, total_rows):
    """Per-row metadata by a python loop: doc, position, doc start, is_real (padding: N, 0, T, False)."""
    n_docs = len(lengths)
    doc, pos, start, real = [], [], [], []
    for b, (s, length) in enumerate(doc_spans(lengths)):
        for p in range(length):
            doc.append(b), pos.append(p), start.append(s), real.append(True)
    while len(doc) < total_rows:
        doc.append(n_docs), pos.append(0), start.append(total_rows), real.append(False)
    return doc, pos, start, real


def loop_layout(lengths, total_rows, max_seqlen, r):
    """Compressed layout by a python loop (docs/semantics.md, decision 4: n_b = L_b // r, the tail makes no entry)."""
    n_docs = len(lengths)
    capacity = min(total_rows // r, n_docs * (max_seqlen // r))
    cu_comp = [0]
    entry_doc, entry_index, entry_first_row = [], [], []
    for b, (s, length) in enumerate(doc_spans(lengths)):
        for j in range(length // r):
            entry_doc.append(b), entry_index.append(j), entry_first_row.append(s + j * r)
        cu_comp.append(cu_comp[-1] + length // r)
    n_real = len(entry_doc)
    assert n_real <= capacity
    entry_is_real = [True] * n_real + [False] * (capacity - n_real)
    entry_doc += [n_docs] * (capacity - n_real)
    entry_index += [0] * (capacity - n_real)
    entry_first_row += [0] * (capacity - n_real)
    first_entry, visible = [], []
    for b, (s, length) in enumerate(doc_spans(lengths)):
        for p in range(length):
            first_entry.append(cu_comp[b])
            visible.append(min((p + 1) // r, length // r))
    visible += [0] * (total_rows - len(visible))
    return dict(capacity=capacity, cu_compressed=cu_comp, entry_doc=entry_doc, entry_index=entry_index,
                entry_first_row=entry_first_row, entry_is_real=entry_is_real, row_first_entry=first_entry,
                row_visible=visible)


def assert_list(tensor, expected, name):
    assert tensor.tolist() == expected, f"{name}: got {tensor.tolist()}, expected {expected}"


@pytest.mark.parametrize("padding", PADDINGS)
def test_rows_match_loop(padding):
    T = sum(LENGTHS) + padding
    pack = dsv4attn.pack_batch(cu_seqlens_of(LENGTHS), T, max(LENGTHS))
    doc, pos, start, real = loop_rows(LENGTHS, T)
    assert pack.total_rows == T and pack.max_seqlen == 130 and pack.num_docs == len(LENGTHS)
    assert pack.cu_seqlens.dtype == torch.int32
    assert_list(pack.row_doc, doc, "row_doc")
    assert_list(pack.row_position, pos, "row_position")
    assert_list(pack.row_doc_start, start, "row_doc_start")
    assert_list(pack.row_is_real, real, "row_is_real")
    assert pack.num_real_rows.dim() == 0 and int(pack.num_real_rows) == sum(LENGTHS)
    for name in ("row_doc", "row_position", "row_doc_start"):
        assert getattr(pack, name).dtype == torch.int64, name


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("ratio", [4, 128], ids=["r4", "r128"])
@pytest.mark.parametrize("max_seqlen", [130, 512], ids=["max_seqlen=longest", "max_seqlen=512"])
def test_compressed_layout_matches_loop(padding, ratio, max_seqlen):
    T = sum(LENGTHS) + padding
    pack = dsv4attn.pack_batch(cu_seqlens_of(LENGTHS), T, max_seqlen)
    lay = pack.compressed(ratio)
    want = loop_layout(LENGTHS, T, max_seqlen, ratio)
    assert lay.ratio == ratio
    assert lay.capacity == want["capacity"] == min(T // ratio, len(LENGTHS) * (max_seqlen // ratio))
    assert lay.max_per_doc == min(max_seqlen, T) // ratio     # no document is longer than the batch
    for name in ("cu_compressed", "entry_doc", "entry_index", "entry_first_row", "entry_is_real", "row_visible"):
        assert_list(getattr(lay, name), want[name], name)
    # The first compressed row of the document is only meaningful for real rows.
    real = sum(LENGTHS)
    assert_list(lay.row_first_entry[:real], want["row_first_entry"], "row_first_entry (real rows)")
    assert_list(lay.entry_position, [j * ratio for j in want["entry_index"]], "entry_position")
    assert pack.compressed(ratio) is lay, "layouts are built once per ratio and cached"


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("window", [1, 4, 128, 1000], ids=lambda w: f"w{w}")
def test_window_start(padding, window):
    T = sum(LENGTHS) + padding
    pack = dsv4attn.pack_batch(cu_seqlens_of(LENGTHS), T, 130)
    _, _, start, real = loop_rows(LENGTHS, T)
    want = [max(start[t], t - window + 1) for t in range(T)]
    assert_list(pack.window_start(window), want, "window_start")
    # docs/semantics.md, decision 3: query at position p sees raw rows p-w+1 .. p, both inclusive, clipped at the
    # document start.
    idx = Window(pack, window).materialize()
    for t in range(T):
        got = sorted(i for i in idx[t].tolist() if i >= 0)
        expected = list(range(want[t], t + 1)) if real[t] else []
        assert got == expected, f"row {t}: window rows {got}, expected {expected}"


@pytest.mark.parametrize("ratio", [4, 128], ids=["r4", "r128"])
def test_visible_compressed_index_set(ratio):
    T = sum(LENGTHS) + 9
    pack = dsv4attn.pack_batch(cu_seqlens_of(LENGTHS), T, 130)
    lay = pack.compressed(ratio)
    offset = 1000
    idx = VisibleCompressed(lay, T, offset=offset).materialize()
    assert idx.shape == (T, 130 // ratio)
    _, pos, _, real = loop_rows(LENGTHS, T)
    doc = pack.row_doc.tolist()
    cu_comp = lay.cu_compressed.tolist()
    for t in range(T):
        got = [i for i in idx[t].tolist() if i >= 0]
        if not real[t]:
            assert got == [], f"padding row {t} sees {got}"
            continue
        length = LENGTHS[doc[t]]
        visible = min((pos[t] + 1) // ratio, length // ratio)
        assert got == [offset + cu_comp[doc[t]] + j for j in range(visible)], f"row {t}"


def test_single_document_when_cu_seqlens_is_none():
    pack = dsv4attn.pack_batch(None, 10)
    assert pack.cu_seqlens.tolist() == [0, 10] and pack.cu_seqlens.dtype == torch.int32
    assert pack.max_seqlen == 10 and pack.num_docs == 1
    assert_list(pack.row_doc, [0] * 10, "row_doc")
    assert_list(pack.row_position, list(range(10)), "row_position")
    assert_list(pack.row_doc_start, [0] * 10, "row_doc_start")
    assert bool(pack.row_is_real.all()) and int(pack.num_real_rows) == 10
    lay = pack.compressed(4)
    assert lay.capacity == 2
    assert_list(lay.cu_compressed, [0, 2], "cu_compressed")
    assert_list(lay.entry_first_row, [0, 4], "entry_first_row")
    assert_list(lay.row_visible, [min((p + 1) // 4, 2) for p in range(10)], "row_visible")
    assert pack.compressed(128).capacity == 0


def test_max_seqlen_none_is_computed():
    pack = dsv4attn.pack_batch(cu_seqlens_of(LENGTHS), sum(LENGTHS) + 3)
    assert pack.max_seqlen == 130


@pytest.mark.parametrize("cu, T", [([0], 5), ([0, 0], 6), ([0, 0, 0], 0)], ids=["no-docs", "one-empty-doc",
                                                                                "empty-batch"])
def test_all_padding(cu, T):
    pack = dsv4attn.pack_batch(torch.tensor(cu, dtype=torch.int32), T, 0)
    n_docs = len(cu) - 1
    assert_list(pack.row_doc, [n_docs] * T, "row_doc")
    assert_list(pack.row_is_real, [False] * T, "row_is_real")
    assert_list(pack.row_position, [0] * T, "row_position")
    assert int(pack.num_real_rows) == 0
    for r in (4, 128):
        lay = pack.compressed(r)
        assert lay.capacity == 0
        assert_list(lay.row_visible, [0] * T, "row_visible")
        assert_list(lay.cu_compressed, [0] * (n_docs + 1), "cu_compressed")


@pytest.mark.parametrize("cu, T, max_seqlen, err", [
    ([1, 3], 5, 2, ValueError), ([0, 4, 2], 5, 4, ValueError), ([0, 6], 5, 6, ValueError),
    ([0, 3], 5, 2, ValueError)], ids=["start-not-0", "decreasing", "past-total-rows", "max_seqlen-too-small"])
def test_invalid_cu_seqlens_raise(cu, T, max_seqlen, err):
    with pytest.raises(err):
        dsv4attn.pack_batch(torch.tensor(cu, dtype=torch.int32), T, max_seqlen)


def test_int64_cu_seqlens_rejected():
    with pytest.raises(ValueError, match="int32"):
        dsv4attn.pack_batch(torch.tensor([0, 3]), 3, 3)


@pytest.mark.parametrize("ratio", [0, -4, 4.0, True], ids=["zero", "negative", "float", "bool"])
def test_compressed_bad_ratio_names_it(ratio):
    """A zero ratio raised torch's ZeroDivisionError, a negative one an arange error; a float built a layout of
    float capacities. Now each is a ValueError naming ratio."""
    pack = dsv4attn.pack_batch(torch.tensor([0, 5], dtype=torch.int32), 8, 5)
    with pytest.raises(ValueError, match=r"ratio must be an int >= 1"):
        pack.compressed(ratio)


# ------------------------------------------------------------------ fixed shapes and refilling (CUDA-graph replay)
PACK_TENSORS = ("cu_seqlens", "row_doc", "row_position", "row_doc_start", "row_is_real", "num_real_rows")
LAYOUT_TENSORS = ("cu_compressed", "entry_doc", "entry_index", "entry_first_row", "entry_is_real",
                  "row_first_entry", "row_visible", "entry_position")


def _assert_same_pack(got, want, ratios=(4, 128)):
    for name in PACK_TENSORS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.total_rows, got.max_seqlen) == (want.total_rows, want.max_seqlen)
    for r in ratios:
        a, b = got.compressed(r), want.compressed(r)
        assert (a.capacity, a.max_per_doc) == (b.capacity, b.max_per_doc), r
        for name in LAYOUT_TENSORS:
            assert torch.equal(getattr(a, name), getattr(b, name)), (r, name)


def test_num_docs_pads_with_empty_documents():
    cu = cu_seqlens_of(LENGTHS)
    T = int(cu[-1]) + 9
    padded = torch.cat([cu, cu[-1:].repeat(3)])
    _assert_same_pack(dsv4attn.pack_batch(cu, T, 130, num_docs=len(LENGTHS) + 3),
                      dsv4attn.pack_batch(padded, T, 130))
    single = dsv4attn.pack_batch(None, 40, num_docs=4)
    assert single.cu_seqlens.tolist() == [0, 40, 40, 40, 40] and single.max_seqlen == 40
    assert dsv4attn.pack_batch(cu, T, 130, num_docs=len(LENGTHS)).cu_seqlens.tolist() == cu.tolist()


@pytest.mark.parametrize("num_docs, message", [(6, "num_docs=6 is fewer than the batch's 7 documents"),
                                               (0, "num_docs must be an int >= 1"),
                                               (2.0, "num_docs must be an int >= 1")])
def test_num_docs_refuses_what_cannot_hold_the_batch(num_docs, message):
    cu = cu_seqlens_of(LENGTHS)
    with pytest.raises(ValueError, match=message):
        dsv4attn.pack_batch(cu, int(cu[-1]), None, num_docs=num_docs)


def test_copy_refills_every_tensor_and_built_layout_in_place():
    """A pack refilled with another batch's pack equals that pack, in the same tensor objects (what a captured
    CUDA graph reads); layouts it had not built are built from the new batch when first asked for."""
    T, docs = 300, 9
    static = dsv4attn.pack_batch(cu_seqlens_of(LENGTHS), T, 200, num_docs=docs)
    before_cu = static.cu_seqlens
    layout = static.compressed(4)
    ptrs = {name: getattr(static, name).data_ptr() for name in PACK_TENSORS}
    other = dsv4attn.pack_batch(cu_seqlens_of((130, 0, 64, 3, 1, 97)), T, 200, num_docs=docs)
    assert static.copy_(other) is static
    _assert_same_pack(static, other)
    assert static.cu_seqlens is before_cu and static.compressed(4) is layout
    assert {name: getattr(static, name).data_ptr() for name in PACK_TENSORS} == ptrs
    assert static.host_cu_seqlens == other.host_cu_seqlens
    assert static.same_cu_seqlens(other.cu_seqlens)


@pytest.mark.parametrize("case", ["rows", "max_seqlen", "docs", "not_a_pack"])
def test_copy_refuses_other_shapes_and_changes_nothing(case):
    cu = cu_seqlens_of(LENGTHS)
    static = dsv4attn.pack_batch(cu, 200, 150, num_docs=8)
    static.compressed(4)
    kept = {name: getattr(static, name).clone() for name in PACK_TENSORS}
    other, message = {
        "rows": (dsv4attn.pack_batch(cu, 201, 150, num_docs=8), "total_rows differs"),
        "max_seqlen": (dsv4attn.pack_batch(cu, 200, 151, num_docs=8), "max_seqlen differs"),
        "docs": (dsv4attn.pack_batch(cu, 200, 150, num_docs=9), r"num_docs=N"),
        "not_a_pack": (cu, "copy_ needs a PackedBatch"),
    }[case]
    with pytest.raises(TypeError if case == "not_a_pack" else ValueError, match=message):
        static.copy_(other)
    for name, value in kept.items():
        assert torch.equal(getattr(static, name), value), name


def test_host_values_survive_dataclass_copies():
    """The validated cu_seqlens values are not a dataclass field (compile guards), yet ``dataclasses.replace`` and
    FSDP2's input casts (``torch.distributed.utils._apply_to_tensors``, which rebuilds dataclass arguments) keep
    them: context parallelism's agreement digests them."""
    import dataclasses

    from torch.distributed.utils import _apply_to_tensors

    pack = dsv4attn.pack_batch(torch.tensor([0, 5, 5, 12], dtype=torch.int32), 16)
    assert pack.host_cu_seqlens == (0, 5, 5, 12)
    assert "host_values" not in {f.name for f in dataclasses.fields(pack)}
    assert dataclasses.replace(pack, cp_partition="contiguous").host_cu_seqlens == (0, 5, 5, 12)
    assert _apply_to_tensors(lambda t: t, pack).host_cu_seqlens == (0, 5, 5, 12)
