"""Index-set combinators: Stack (query ranges on top of each other) and Rows (offset / shift / table); host bounds
and ``within`` (the ops' index safety)."""
import torch

from dsv4attn import pack_batch
from dsv4attn.ops.index_sets import Concat, Explicit, Rows, Stack, VisibleCompressed, Window, row_ends, within


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
