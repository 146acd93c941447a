"""Index-set combinators: Stack (query ranges on top of each other) and Rows (offset / shift / table); host bounds
and ``within`` (the ops' index safety)."""
import torch

from dsv4attn import pack_batch
from dsv4attn.ops.index_sets import (Concat, Explicit, Rows, Stack, VisibleCompressed, Window, contiguous_ranges,
                                     range_part_starts, range_rows, row_ends, within)


def test_stack_pads_narrow_parts_and_splits_any_row_range():
    a = Explicit(torch.tensor([[0, 1], [2, -1], [3, 4]]))
    b = Explicit(torch.tensor([[5, 6, 7], [-1, 8, 9]]), offset=10)
    s = Stack(a, b)
    assert (s.total_rows, s.width) == (5, 3)
    want = torch.tensor([[0, 1, -1], [2, -1, -1], [3, 4, -1], [15, 16, 17], [-1, 18, 19]])
    assert torch.equal(s.materialize(), want)
    for start in range(5):
        for end in range(start + 1, 6):
            assert torch.equal(s.rows(start, end), want[start:end]), (start, end)


def test_rows_maps_valid_entries_through_the_table_then_shifts():
    base = Explicit(torch.tensor([[0, 2], [1, -1], [2, 0], [-1, -1]]))
    table = torch.tensor([7, 5, 3])
    r = Rows(base, row_offset=1, total_rows=3, shift=100, table=table)
    assert torch.equal(r.materialize(), torch.tensor([[105, -1], [103, 107], [-1, -1]]))


def test_bounds_hold_and_within_trusts_only_proven_sets():
    pack = pack_batch(torch.tensor([0, 9, 9, 30], dtype=torch.int32), 36, 21)
    layout = pack.compressed(4)
    window, visible = Window(pack, 5), VisibleCompressed(layout, 36)
    topk = Explicit(torch.tensor([[0, -1]] * 36), offset=36, bound=layout.capacity)
    sets = {"window": (window, 36), "visible": (visible, layout.capacity),
            "shifted": (Rows(visible, 0, 36, shift=36), 36 + layout.capacity),
            "concat": (Concat(window, topk), 36 + layout.capacity), "stack": (Stack(window, visible), 36)}
    for name, (index_set, bound) in sets.items():
        assert index_set.bound == bound, name
        assert int(index_set.materialize().max()) < bound, name           # the bound holds
        assert within(index_set, bound) is index_set, name                 # proven: nothing to do
    assert Rows(visible, 0, 36, table=torch.arange(layout.capacity)).bound is None   # a table: unknown
    assert Concat(window, Explicit(torch.zeros(36, 1, dtype=torch.long))).bound is None
    assert within(window, 35) is not window                        # the bound (36) does not prove 35 rows enough
    clipped = within(window, 20).materialize()                     # rows >= 20 become empty slots, others stay
    assert torch.equal(clipped, torch.where(window.materialize() < 20, window.materialize(), -1))
    assert int(clipped.max()) == 19


def test_rows_in_int32_equal_the_int64_rows():
    """What the kernels take (int32, every pass done in it) equals the int64 rows of every kind of set: a window with
    padding rows, every visible entry (plain, offset), a top-k with an offset, mapped Rows views, Concat, Stack and a
    masked set; whole and by chunks."""
    from dsv4attn.ops.sparse_attention.op import _FirstSlots
    pack = pack_batch(torch.tensor([0, 9, 9, 30], dtype=torch.int32), 36, 21)
    layout = pack.compressed(4)
    window, visible = Window(pack, 5), VisibleCompressed(layout, 36, offset=36)
    topk = Explicit(torch.randint(-1, layout.capacity, (36, 3), generator=torch.Generator().manual_seed(0),
                                  dtype=torch.int32), offset=36, bound=layout.capacity)
    table = torch.randperm(layout.capacity, generator=torch.Generator().manual_seed(1))
    sets = [window, visible, topk, Concat(window, topk), Concat(window, visible),
            Rows(VisibleCompressed(layout, 36), 3, 30, shift=11, table=table),
            Stack(Rows(window, 0, 13, shift=4), Rows(visible, 13, 23)), within(window, 20), within(topk, 40),
            _FirstSlots(Concat(window, topk), torch.arange(36) % 9)]
    for index_set in sets:
        for start, end in ((0, index_set.total_rows), (0, 1), (4, 11), (11, index_set.total_rows), (5, 5)):
            narrow = index_set.rows(start, end, torch.int32)
            assert narrow.dtype == torch.int32, type(index_set).__name__
            assert torch.equal(narrow.long(), index_set.rows(start, end)), (type(index_set).__name__, start, end)


def test_rows_narrowed_to_int32_never_wrap_a_value_into_a_row():
    """An int64 value int32 cannot hold (after the offset) is an empty slot in the int32 rows, not a wrapped row."""
    e = Explicit(torch.tensor([[2 ** 32 + 5, 3, -1, 2 ** 31 - 2, -2 ** 32 + 7]]), offset=2)
    assert e.rows(0, 1, torch.int32).tolist() == [[-1, 5, -1, -1, -1]]
    assert within(Concat(e, e), 10).rows(0, 1, torch.int32).tolist() == [[-1, 5, -1, -1, -1] * 2]


def test_within_masks_explicit_sets_keeping_them_explicit():
    e = Explicit(torch.tensor([[0, 3, -1, 9], [2, -3, 5, 4]]), offset=2)
    masked = within(e, 6)                                     # rows 2 + v < 6: v in {0, 3, 2}; 5 and 4 and 9 go
    assert isinstance(masked, Explicit) and masked.bound == 6
    assert torch.equal(masked.materialize(), torch.tensor([[2, 5, -1, -1], [4, -3, -1, -1]]))


def test_row_ends_is_one_past_each_rows_last_valid_slot():
    idx = torch.tensor([[3, -1, 5, -1, -1],         # a hole before the last valid slot does not end the row
                        [-1, -1, -1, -1, -1],       # no valid slot
                        [0, 1, 2, 3, 4],
                        [-1, -1, -1, -1, 7]], dtype=torch.int32)
    ends = row_ends(idx)
    assert ends.dtype == torch.int32
    assert ends.tolist() == [3, 0, 5, 5]
    assert row_ends(idx[:, :0]).tolist() == [0, 0, 0, 0]
    assert row_ends(idx[:0]).shape == (0,)


def test_range_rows_rebuild_the_sets_contiguous_ranges_describe():
    """What the kernels take for the warm-up's every visible entry (per-row first entry and count, an entry table, a
    shift) gives back the set's own rows, chunk by chunk: the set itself, an offset base, a Rows view with a table
    and a shift, and a context-parallel rank's Stack of such views; other sets have no ranges."""
    pack = pack_batch(torch.tensor([0, 9, 9, 30, 37], dtype=torch.int32), 40, 21)
    layout = pack.compressed(4)
    visible = VisibleCompressed(layout, 40)
    table = torch.randperm(layout.capacity, generator=torch.Generator().manual_seed(0))
    sets = {"visible": visible, "offset": VisibleCompressed(layout, 40, offset=6),
            "rows": Rows(visible, 3, 30, shift=11, table=table, bound=layout.capacity),
            "stack": Stack(Rows(visible, 0, 13, shift=11, table=table), Rows(visible, 25, 15, shift=11, table=table))}
    for name, index_set in sets.items():
        first, count, tbl, shift = contiguous_ranges(index_set)
        assert first.shape == count.shape == (index_set.total_rows,), name
        want = index_set.materialize()
        for start, end in ((0, index_set.total_rows), (0, 4), (4, 11), (11, index_set.total_rows)):
            got = range_rows(first, count, tbl, shift, index_set.width, start, end)
            assert torch.equal(got, want[start:end]), (name, start, end)
            narrow = range_rows(first, count, tbl, shift, index_set.width, start, end, dtype=torch.int32)
            assert narrow.dtype == torch.int32 and torch.equal(narrow.long(), want[start:end]), (name, start, end)
        # The rows where a Stack's parts begin (the score kernels take each on its own), nested Stacks flattened.
        assert range_part_starts(index_set) == ([13] if name == "stack" else []), name
    nested = Stack(Rows(visible, 0, 5), Stack(Rows(visible, 5, 7), Rows(visible, 20, 3)), Rows(visible, 30, 2))
    assert range_part_starts(nested) == [5, 12, 15]
    assert contiguous_ranges(nested)[0].shape == (17,)
    other_table = Stack(Rows(visible, 0, 13, table=table), Rows(visible, 13, 27, table=table.flip(0)))
    for index_set in (Window(pack, 5), Explicit(torch.zeros(40, 2, dtype=torch.long)), Concat(visible, visible),
                      other_table, Stack(visible, Window(pack, 5))):
        assert contiguous_ranges(index_set) is None
