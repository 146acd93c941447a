"""The README's example job runs and keeps padding rows at zero."""
from dsv4attn import demo


def test_demo_runs(capsys):
    demo.main(["--padding", "3"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.split()[:1] in (["window"], ["CSA"], ["HCA"])]
    assert len(rows) == 9
    assert all(line.split()[4] == "True" for line in rows)
