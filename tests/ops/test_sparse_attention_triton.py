"""Triton sparse attention kernels (forward + backward) vs the float64 reference, on CPU via TRITON_INTERPRET=1.

The interpreter must be switched on before Triton is first imported, and pytest may already have imported it
through other test modules, so every kernel run happens in one subprocess (``_worker`` below) that sets the
variable first and prints its measurements as JSON; the parametrised tests only judge those numbers.

Bound (STYLE.md): kernel error <= 2x (out, lse) / 3x (dq, dkv, d_sink) the error of the reference op run in the
same low dtype, both against the float64 reference on the same (rounded) inputs; fp32 must be within 1e-5 of the
largest magnitude. A small floor (1e-6 of the largest magnitude) absorbs fp32 summation-order noise where the
reference's own error is ~0 (lse, exactly representable cases).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NAMES = ("out", "lse", "dq", "dkv", "d_sink")
GRADS = ("dq", "dkv", "d_sink")


def _case(dtype, H, sink="randn", T=16, D=64, K=24, N=48, int32=False):
    return dict(dtype=dtype, H=H, sink=sink, T=T, D=D, K=K, N=N, int32=int32)


CASES = {
    f"{dt}-H{H}": _case(dt, H) for dt in DTYPES for H in (2, 5)
}
CASES.update({
    "bf16-H5-sink-inf": _case("bf16", 5, sink="-inf"),
    "fp32-H2-sink-inf": _case("fp32", 2, sink="-inf"),
    "bf16-H2-sink+30": _case("bf16", 2, sink="large"),
    "fp32-H5-sink+30": _case("fp32", 5, sink="large"),
    "bf16-H5-K70-multiblock": _case("bf16", 5, K=70, N=90),
    "fp32-H2-K70-multiblock-int32": _case("fp32", 2, K=70, N=90, int32=True),
    "fp32-H5-D128": _case("fp32", 5, D=128, K=40),
})


def _inputs(c, seed):
    gen = torch.Generator().manual_seed(seed)
    T, H, D, K, N = c["T"], c["H"], c["D"], c["K"], c["N"]
    dt = DTYPES[c["dtype"]]
    q = torch.randn(T, H, D, generator=gen, dtype=torch.float64).to(dt)
    kv = torch.randn(N, D, generator=gen, dtype=torch.float64).to(dt)
    grad_out = torch.randn(T, H, D, generator=gen, dtype=torch.float64).to(dt)
    sink = {"randn": torch.randn(H, generator=gen, dtype=torch.float64),
            "-inf": torch.full((H,), -math.inf, dtype=torch.float64),
            "large": torch.full((H,), 30.0, dtype=torch.float64)}[c["sink"]].float()
    idx = torch.randint(0, N, (T, K), generator=gen)
    idx[torch.rand(T, K, generator=gen) < 0.3] = -1                  # holes
    idx[:, 1] = idx[:, 0]                                             # repeated slots: each occurrence counts
    idx[0, 1] = -1
    idx[3] = -1                                                       # rows with no valid index
    idx[T - 1] = -1
    return q, kv, idx.to(torch.int32 if c["int32"] else torch.int64), sink, grad_out


def _run(fn, q, kv, idx, sink, grad_out):
    from dsv4attn.ops.index_sets import Explicit
    q, kv, sink = (x.detach().clone().requires_grad_(True) for x in (q, kv, sink))
    D = q.shape[-1]
    out, lse = fn(q, kv, Explicit(idx), sink, D ** -0.5)
    out.backward(grad_out.to(out.dtype))
    return [x.detach().to(torch.float64) for x in (out, lse, q.grad, kv.grad, sink.grad)]


def _compare(kernel, ref_low, exact):
    result = {}
    for name, k, r, e in zip(NAMES, kernel, ref_low, exact):
        finite = torch.isfinite(e)
        same_pattern = bool((torch.isfinite(k) == finite).all() and (k[~finite] == e[~finite]).all())
        err_k = (k - e)[finite].abs().max().item() if finite.any() else 0.0
        err_r = (r - e)[finite].abs().max().item() if finite.any() else 0.0
        mag = e[finite].abs().max().item() if finite.any() else 0.0
        result[name] = dict(err_kernel=err_k, err_ref=err_r, magnitude=mag, same_pattern=same_pattern)
    return result


def _worker() -> None:
    """Runs in the subprocess (TRITON_INTERPRET=1 already set): every case, printed as one JSON object."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from dsv4attn import backend
    from dsv4attn.ops import sparse_attention
    from dsv4attn.ops.sparse_attention import triton as sa_triton
    from dsv4attn.ops.sparse_attention.reference import sparse_attention_reference

    results, kernel_outputs = {}, {}
    for seed, (case_id, c) in enumerate(CASES.items()):
        q, kv, idx, sink, grad_out = _inputs(c, seed)
        # The reference turns (empty row, sink = -inf) into 0/0; a sink of -1e30 has identical semantics (it adds
        # exactly 0 to every denominator) and keeps the oracle finite. The kernel gets the true -inf.
        ref_sink = sink.masked_fill(sink == -math.inf, -1e30)
        kernel = kernel_outputs[case_id] = _run(sa_triton.sparse_attention_triton, q, kv, idx, sink, grad_out)
        ref_low = _run(sparse_attention_reference, q, kv, idx, ref_sink, grad_out)
        exact = _run(sparse_attention_reference, q.double(), kv.double(), idx, ref_sink.double(), grad_out.double())
        results[case_id] = _compare(kernel, ref_low, exact)

    # Plumbing: registration, dispatch through the public op, and the documented fp64 fallback.
    case_id = "bf16-H5"
    q, kv, idx, sink, grad_out = _inputs(CASES[case_id], list(CASES).index(case_id))
    backend.set_backend("triton")
    public = _run(lambda q_, kv_, ix, s_, sc: sparse_attention(q_, kv_, ix, s_, sc), q, kv, idx, sink, grad_out)
    backend.set_backend(None)
    direct = kernel_outputs[case_id]
    q64, kv64, s64, g64 = q.double(), kv.double(), sink.double(), grad_out.double()
    fb = _run(sa_triton.sparse_attention_triton, q64, kv64, idx, s64, g64)
    ref = _run(sparse_attention_reference, q64, kv64, idx, s64, g64)
    results["plumbing"] = dict(
        registered="sparse_attention" in backend.registered_kernels()
        and backend.kernel("sparse_attention") is sa_triton.sparse_attention_triton,
        public_matches_direct=all(torch.equal(a, b) for a, b in zip(public, direct)),
        fp64_fallback_is_reference=all(torch.equal(a, b) for a, b in zip(fb, ref)),
    )
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = "from tests.ops.test_sparse_attention_triton import _worker; _worker()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"interpreter worker failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("case_id", list(CASES))
def test_kernel_matches_float64_reference(interpreted, case_id):
    low_precision = CASES[case_id]["dtype"] != "fp32"
    for name, m in interpreted[case_id].items():
        assert m["same_pattern"], f"{case_id} {name}: NaN/inf pattern differs from the float64 reference"
        if low_precision:
            factor = 3.0 if name in GRADS else 2.0
            bound = factor * m["err_ref"] + 1e-6 * m["magnitude"]
        else:
            bound = 1e-5 * max(m["magnitude"], 1e-30)
        assert m["err_kernel"] <= bound, (
            f"{case_id} {name}: kernel error {m['err_kernel']:.3e} > bound {bound:.3e} "
            f"(reference in low precision: {m['err_ref']:.3e}, magnitude {m['magnitude']:.3e})")


@pytest.mark.parametrize("check", ["registered", "public_matches_direct", "fp64_fallback_is_reference"])
def test_plumbing(interpreted, check):
    assert interpreted["plumbing"][check]
