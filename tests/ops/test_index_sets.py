"""Index-set combinators: Stack (query ranges on top of each other) and Rows (offset / shift / table)."""
import torch

from dsv4attn.ops.index_sets import Explicit, Rows, Stack


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
