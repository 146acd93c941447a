"""``benchmarks/kernel_variants.py``: a variant is the shipped module's source with each change applied exactly once,
imported beside the original (its relative imports resolve), its kernels distinct objects; a change whose text
does not occur exactly once is refused with its name."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kernel_variants as kv  # noqa: E402

MODULE = "dsv4attn.ops.sparse_attention.gluon_hopper"


def test_a_variant_imports_beside_the_original(tmp_path):
    shipped = importlib.import_module(MODULE)
    source = Path(shipped.__file__).read_text()
    changed = kv.patched_source(source, [("FWD_CONFIG = dict(BLOCK_N=64", "FWD_CONFIG = dict(BLOCK_N=32")], "n32")
    variant = kv.load_variant(MODULE, "n32", changed, tmp_path)
    assert variant.__name__ == "dsv4attn.ops.sparse_attention.gluon_hopper__n32"
    assert variant.FWD_CONFIG["BLOCK_N"] == 32 and shipped.FWD_CONFIG["BLOCK_N"] == 64
    if shipped.IMPORTED:               # Gluon present: the variant defines its own kernel
        assert variant._sparse_attn_fwd_gluon is not shipped._sparse_attn_fwd_gluon


@pytest.mark.parametrize("old", ["no such text", "gl."])
def test_a_change_must_match_exactly_once(old):
    with pytest.raises(SystemExit, match=r"variant 'bad': .* occurs \d+ times in the source, not once"):
        kv.patched_source("gl.a gl.b", [(old, "x")], "bad")


def test_every_waiting_variant_still_applies():
    """The variants waiting for a GPU run (benchmarks/variants/, none at times) still apply to the shipped source:
    each change's text occurs exactly once."""
    import runpy
    for path in sorted((Path(kv.ROOT) / "benchmarks" / "variants").glob("*.py")):
        spec = runpy.run_path(str(path))
        module = importlib.import_module(spec.get("MODULE", "dsv4attn.ops.sparse_attention.gluon_hopper"))
        source = Path(module.__file__).read_text()
        assert spec["VARIANTS"], path.name
        for name, changes in spec["VARIANTS"].items():
            assert kv.patched_source(source, changes, name) != source, (path.name, name)
