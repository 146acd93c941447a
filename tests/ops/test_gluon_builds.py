"""Every Gluon (SM90) kernel builds for sm_90 with the installed Triton, compiled offline: no GPU needed.

Gluon is experimental and its names move between Triton releases (the shims are in dsv4attn/ops/gluon_common.py).
On a GPU a kernel that no longer builds only shows as a warning and a fall back to the Triton kernels, and the GPU
tests are not run by CPU CI: this test makes CI's Triton build each kernel (Gluon front end, MLIR passes, ptxas)
once, at its launcher's default config (the forward also with the output rotation), with the launcher's argument
types (bf16, D = 512 for the attention; pointer arguments 16-byte aligned, as the runtime specialises them), and
checks that its shared memory fits an SM90 block and that ptxas does not serialize its wgmma products (the
exceptions are listed, with their reason, in ``SERIALIZED``).
Cost with a cold Triton cache on a 2-core CPU: about 40 s of CPU time with Triton 3.9, 25 s with 3.6 (one child
process compiles all twelve; a warm cache skips the compiles, not the second ptxas run that reads its log).

:func:`gluon_kernels` and :func:`compile_sm90` also serve offline studies of a kernel (registers, spills, SASS).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4attn.ops import gluon_common

ROOT = Path(__file__).resolve().parents[2]
SM90_SHARED_MEMORY_BYTES = 232448           # the most one SM90 thread block may allocate


def gluon_kernels():
    """(name, jit function, signature, constexprs) of every Gluon kernel, at its launcher's defaults."""
    from triton.runtime.jit import mangle_type

    from dsv4attn.ops.indexer import gluon_hopper as scores
    from dsv4attn.ops.indexer_loss import gluon_hopper as kl
    from dsv4attn.ops.sparse_attention import gluon_hopper as attn, gluon_hopper_bwd as attn_bwd

    bf, f32, i32, i64 = "*bf16", "*fp32", "*i32", "*i64"
    fwd, bwd, kl_cfg = attn.FWD_CONFIG, attn_bwd.BWD_CONFIG, kl.CONFIG
    # The query descriptor of the score kernel's TMA producer, typed as the runtime types the one launch_orders makes.
    q = torch.empty(scores.BLOCK_T, scores.HEADS * scores.HEAD_DIM, dtype=torch.bfloat16)
    layout = gluon_common.gl.NVMMASharedLayout.get_default_for([scores.BLOCK_T, scores.HEAD_DIM],
                                                               gluon_common.gl.bfloat16)
    q_desc = mangle_type(gluon_common.TensorDescriptor.from_tensor(q, [scores.BLOCK_T, scores.HEAD_DIM], layout))
    # The teacher kernels' range form: the descriptor of the kv in 64-row blocks at D = 512.
    rows = torch.empty(64, 512, dtype=torch.bfloat16)
    row_desc = mangle_type(gluon_common.TensorDescriptor.from_tensor(
        rows, [64, 512], gluon_common.gl.NVMMASharedLayout.get_default_for([64, 512], gluon_common.gl.bfloat16)))
    score_sig = dict(Q_DESC=q_desc, K=bf, W_=f32, FIRST=i64, VISIBLE=i64, TABLE=i64, ORDERS=i32, rows_c="i32",
                     width="i32", shift="i32")
    # The score kernel with and without the layout's lowering table.
    score_consts = {table: dict(HAS_TABLE=table, STAGES=scores.CONFIG["STAGES"], num_warps=4,
                                REGS=tuple(scores.CONFIG["REGS"])) for table in (False, True)}
    return [
        # The forward without and with the output's inverse RoPE (32 channel pairs: as the layer calls it; last, so
        # that benchmarks/kernel_variants.py, which keeps one entry per jit function, builds this one).
        *[(name, attn._sparse_attn_fwd_gluon,
           dict(Q=bf, KV=bf, IDX=i32, NEND=i32, SINK=f32, OUT=bf, LSE=f32, COS=f32, SIN=f32, H="i32", K="i32",
                qk_scale_log2="fp32"),
           dict(D=512, BLOCK_N=fwd["BLOCK_N"], STAGES=fwd["STAGES"], num_warps=4, REGS=tuple(fwd["REGS"]), ROPE=rope))
          for name, rope in (("attn_fwd_no_rope", 0), ("attn_fwd", 32))],
        ("teacher_mass", attn._teacher_mass_gluon,
         dict(Q=bf, CKV=bf, IDX=i32, NEND=i32, FULL_LSE=f32, MASS=f32, H="i32", K="i32", qk_scale="fp32"),
         dict(D=512, BLOCK_N=fwd["BLOCK_N"], STAGES=fwd["STAGES"], num_warps=4, REGS=tuple(fwd["REGS"]))),
        ("teacher_lse", attn._teacher_lse_gluon,
         dict(Q=bf, CKV=bf, IDX=i32, NEND=i32, LSE=f32, H="i32", K="i32", qk_scale_log2="fp32"),
         dict(D=512, BLOCK_N=fwd["BLOCK_N"], STAGES=fwd["STAGES"], num_warps=4, REGS=tuple(fwd["REGS"]))),
        ("teacher_mass_ranges", attn._teacher_mass_ranges_gluon,
         dict(Q=bf, KV_DESC=row_desc, FIRST=i32, IDX=i32, NEND=i32, FULL_LSE=f32, MASS=f32, T="i32", H="i32",
              K="i32", qk_scale="fp32"),
         dict(D=512, BLOCK_N=fwd["BLOCK_N"], STAGES=attn._pair_stages(fwd["BLOCK_N"], 512), num_warps=4,
              REGS=attn.PAIR_REGS)),
        ("teacher_lse_ranges", attn._teacher_lse_ranges_gluon,
         dict(Q=bf, KV_DESC=row_desc, FIRST=i32, IDX=i32, NEND=i32, LSE=f32, T="i32", H="i32", K="i32",
              qk_scale_log2="fp32"),
         dict(D=512, BLOCK_N=fwd["BLOCK_N"], STAGES=attn._pair_stages(fwd["BLOCK_N"], 512), num_warps=4,
              REGS=attn.PAIR_REGS)),
        # The backward's deterministic form (dKV stored per slot), with the sparse KL's teacher mass, then its
        # default (last: kernel_variants.py).
        *[(name, attn_bwd._sparse_attn_bwd_gluon,
           dict(Q=bf, DO=bf, KV=bf, IDX=i32, NEND=i32, DENOM2=f32, DELTA=f32, DQ=bf, DKV=f32, COS=f32, SIN=f32,
                MASS=f32, H="i32", K="i32", KT="i32", OFF="i32", qk_scale_log2="fp32", scale="fp32"),
           dict(D=512, BLOCK_N=attn_bwd.BLOCK_N, CHUNK=bwd["CHUNK"], num_warps=4, REGS=tuple(bwd["REGS"]), ROPE=32,
                RW=attn_bwd.rotated_width(32), DETERMINISTIC=det, DO_MASS=mass))
          for name, det, mass in (("attn_bwd_deterministic", True, False), ("attn_bwd_mass", False, True),
                                  ("attn_bwd", False, False))],
        ("indexer_scores", scores._indexer_orders_gluon, score_sig, score_consts[False]),
        ("indexer_scores_table", scores._indexer_orders_gluon, score_sig, score_consts[True]),
        ("kl_bwd", kl._indexer_kl_bwd_gluon,
         dict(QI=bf, KI=bf, W_=f32, IDX=i32, NEND=i32, G=f32, GRAD=f32, DQI=bf, DKI=f32, DW=f32, K="i32"),
         dict(BLOCK_N=kl.BLOCK_N, STAGES=kl_cfg["STAGES"], num_warps=4,
              REGS=tuple(kl_cfg["REGS"]))),
        ("kl_bwd_pairs", kl._indexer_kl_bwd_pairs_gluon,
         dict(QI=bf, KI=bf, W_=f32, IDX=i32, NEND=i32, ROW0=i32, ROW1=i32, G=f32, GRAD=f32, DQI=bf, DKI=f32, DW=f32,
              K="i32"),
         dict(BLOCK_N=kl.BLOCK_N, STAGES=kl_cfg["STAGES"], num_warps=4, REGS=tuple(kl_cfg["REGS"]))),
    ]


def compile_sm90(fn, signature: dict, constexprs: dict):
    """``fn`` compiled for sm_90 (CUDA 9.0, 32-thread warps) without a GPU: the compiled kernel (asm, metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = dict(signature, **{name: "constexpr" for name in constexprs})
    aligned = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(signature.values()) if ty.startswith("*")}
    source = GluonASTSource(fn, signature, constexprs, aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=constexprs["num_warps"]))


def ptxas_info(ptx: str) -> dict | None:
    """What ptxas says of ``ptx`` when this Triton builds it for sm_90 (its own ptxas and flags, through the CUDA
    backend's ``make_cubin`` with the ptxas log printed): ``registers``, ``spill_stores`` and ``spill_loads`` (bytes)
    and ``serialized``, the reason of its notice that the kernel's wgmma.mma_async are serialized (C75xx: each
    product then waits for the previous one, whatever the source pipelines), or None. None when the log has no
    register count (a ptxas whose log this does not read)."""
    import contextlib
    import io
    import re
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    log = io.StringIO()
    with knobs.nvidia.scope():
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            backend.make_cubin(ptx, {}, backend.parse_options({}), 90)
    log = log.getvalue()
    regs = re.search(r"Used (\d+) registers", log)
    if regs is None:
        return None
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    serial = re.search(r"wgmma\.mma_async instructions are serialized due to (.*?) (?:for|in) the function", log)
    return dict(registers=int(regs.group(1)), spill_stores=int(spill.group(1)) if spill else 0,
                spill_loads=int(spill.group(2)) if spill else 0, serialized=serial.group(1) if serial else None)


def handed_over_slots_in_scratch(llir: str) -> tuple[list[int], int]:
    """(slots at the base of a scratch buffer, number of scratch buffers found) of a kernel's LLVM IR.

    A slot is where a kernel hands a value formed before ``gl.warp_specialize`` to its partitions: a scalar SSA value
    stored at a constant offset of ``@global_smem``. A scratch buffer is addressed with a runtime offset from a
    constant base (a partition's reduction or layout-conversion scratch, a ring). A partition writing its scratch
    over a slot clobbers the value another partition has not read yet: Triton 3.9 laid out the teacher-mass kernel
    that way (a pointer slot at the base of the first consumer's head-sum scratch, another 8 bytes in), which gave
    wrong masses on the GPU while every compile succeeded. Offset 0 appears as ``@global_smem`` itself. Buffer sizes
    are not in the IR, so a slot inside a buffer but not at its base goes unseen; the count lets a test notice an IR
    format this no longer reads (no buffer found)."""
    import re
    const = r"getelementptr \(i8, ptr addrspace\(3\) @global_smem, i32 (\d+)\)"
    scalar = r"store (?:ptr addrspace\(1\)|i64|i32|float) %[\w.]+, ptr addrspace\(3\) "
    slots = {int(m) for m in re.findall(scalar + const, llir)}
    if re.search(scalar + r"@global_smem\b(?!,\s*i32)", llir):
        slots.add(0)
    bases = {int(m) for m in re.findall(const + r", i32 %", llir)}
    if re.search(r"ptr addrspace\(3\) @global_smem, i32 %", llir):
        bases.add(0)
    return sorted(slots & bases), len(bases)


# Kernels whose wgmma ptxas serializes today (on Triton 3.6.0, 3.7.1 and 3.9.0 alike), with why they ship so.
SERIALIZED = {
    "attn_bwd_deterministic": "the dKV warpgroup's plain stores of each chunk (dq's 128 fp32 registers live beside "
                              "them); two forms with the default's reductions into a zeroed buffer build unserialized "
                              "and wait for a GPU run (BENCHMARKS.md, thirtieth session)",
}
KERNEL_NAMES = ["attn_fwd", "attn_fwd_no_rope", "teacher_mass", "teacher_lse", "teacher_mass_ranges",
                "teacher_lse_ranges", "attn_bwd_deterministic", "attn_bwd_mass", "attn_bwd", "indexer_scores",
                "indexer_scores_table", "kl_bwd", "kl_bwd_pairs"]


def _worker():
    """Compiles every kernel; prints one ``RESULTS <json>`` line: per kernel its shared memory or its error."""
    results = {}
    for name, fn, signature, constexprs in gluon_kernels():
        try:
            kernel = compile_sm90(fn, signature, constexprs)
            results[name] = dict(shared=kernel.metadata.shared, cubin=len(kernel.asm["cubin"]),
                                 scratch=handed_over_slots_in_scratch(kernel.asm["llir"]),
                                 ptxas=ptxas_info(kernel.asm["ptx"]))
        except Exception as exc:                # reported by the test of this kernel
            results[name] = dict(error=f"{type(exc).__name__}: {str(exc)[-3000:]}")
    print("RESULTS " + json.dumps(results), flush=True)


@pytest.fixture(scope="module")
def builds():
    # In a child process: the compiles' state stays out of the test session (and Triton 3.9's nanobind reports
    # leaked objects at the exit of a process that compiled Gluon, noise for the session's output).
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    code = "from tests.ops.test_gluon_builds import _worker; _worker()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, f"the compile worker failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.skipif(not gluon_common.IMPORTED, reason="this Triton has no usable Gluon")
@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_gluon_kernel_builds_for_sm90(builds, name):
    import triton

    assert sorted(builds) == sorted(KERNEL_NAMES), "gluon_kernels() and KERNEL_NAMES list different kernels"
    result = builds[name]
    assert "error" not in result, f"{name} does not build with Triton {triton.__version__}: {result.get('error')}"
    assert result["cubin"] > 0
    assert 0 < result["shared"] <= SM90_SHARED_MEMORY_BYTES, \
        f"{name}: {result['shared']} bytes of shared memory, more than an SM90 block has"
    clobbered, buffers = result["scratch"]
    assert buffers, f"{name}: no shared-memory buffer found in its LLVM IR (has the IR format changed?)"
    assert not clobbered, (
        f"{name}, Triton {triton.__version__}: a value handed to the warp-specialized partitions sits at shared-memory "
        f"offset(s) {clobbered}, inside a partition's scratch; derive it inside each partition instead")
    # A build that succeeds can still be slow: ptxas serializes every wgmma of a kernel it cannot give the registers
    # of its asynchronous products (a Triton release moving registers about can do that to a kernel unchanged).
    info = result["ptxas"]
    assert info is not None, (f"{name}: no register count in ptxas's log (Triton {triton.__version__}): has its "
                              f"format changed?")
    if name in SERIALIZED:
        assert info["serialized"], (f"{name}: ptxas no longer serializes its wgmma with Triton {triton.__version__}; "
                                    f"take it out of SERIALIZED")
    else:
        assert not info["serialized"], (
            f"{name}, Triton {triton.__version__}: ptxas serializes its wgmma ({info['serialized']}; spills "
            f"{info['spill_stores']} bytes): every product waits for the one before")


def test_the_package_imports_without_gluon():
    """A Triton without Gluon: dsv4attn and its kernel modules import, IMPORTED is False, nothing is available."""
    code = "\n".join([
        "import sys",
        "sys.modules['triton.experimental.gluon'] = None      # any import of it fails",
        "import torch",
        "from dsv4attn.ops import gluon_common",
        "from dsv4attn.ops.sparse_attention import gluon_hopper, gluon_hopper_bwd, triton as sat",
        "from dsv4attn.ops.indexer import gluon_hopper as scores, triton as it",
        "from dsv4attn.ops.indexer_loss import gluon_hopper as kl, triton as klt",
        "import dsv4attn",
        "assert not gluon_common.IMPORTED and gluon_common.gl is None",
        "q = torch.zeros(1, 64, 512, dtype=torch.bfloat16)",
        "qi = torch.zeros(1, 64, 128, dtype=torch.bfloat16)",
        "assert not (gluon_hopper.available(q) or gluon_hopper_bwd.available(q) or scores.available(qi, qi[0])",
        "            or kl.available(qi, qi[0]))",
        "print('OK')",
    ])
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-2000:] + proc.stderr[-4000:]
