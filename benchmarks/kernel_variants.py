"""Variants of a Gluon kernel module, each one text change away from the shipped source: built offline, or checked
and timed on the GPU beside the shipped kernel (and FlashMLA) in one process.

    python benchmarks/kernel_variants.py VARIANTS.py --build-only          # any machine: sm_90 builds, PTX counts
    python benchmarks/kernel_variants.py VARIANTS.py --T 32768 --H 64 [--flashmla .peers/flashmla] [--rounds 5]

``VARIANTS.py`` (an experiment's definition, not a switch: ``benchmarks/variants/`` holds the ones waiting for a GPU
run; once measured, the figures go to BENCHMARKS.md and a variant either becomes the kernel or is deleted) defines

- ``MODULE``: the module to vary, e.g. ``"dsv4attn.ops.sparse_attention.gluon_hopper"`` (the default);
- ``VARIANTS``: ``{name: [(old, new), ...]}``; each ``old`` must occur exactly once in the module's source;
- optionally ``KERNEL`` (the jit function to build offline, default ``"_sparse_attn_fwd_gluon"``),
  ``BUILD_SIGNATURE`` (the types of arguments the variant's kernel adds, e.g. ``{"NUM_ITEMS": "i32"}``),
  ``BUILD_CONSTEXPRS`` (constexprs the offline builds of every row set, e.g. another form of the kernel),
  ``VARIANT_CONSTEXPRS`` (``{name: constexprs}`` for one variant's row, e.g. the REGS its launcher passes) and
  ``call(module, inputs)`` / ``inputs(T, H, device)`` for another kernel than the attention forward (the default
  calls ``module.launch_fwd`` on ``benchmarks/sparse_attention.py``'s inputs and returns (out, lse)).

Each variant's source is written to a temporary file and imported as a module of the original's package (its
relative imports resolve as the original's do), so its jit functions are distinct kernels with their own cache
entries. ``--build-only`` compiles each variant's kernel for sm_90 without a GPU (as ``tests/ops/test_gluon_builds.py``
does for the shipped ones) and prints its registers, spills, whether ptxas serialized its wgmma (and why), shared
memory and the count of barrier, mbarrier and wgmma instructions in its PTX. On a GPU each variant's outputs are
compared with the shipped kernel's (bitwise, or the largest difference), then both are timed in alternating rounds
(``gpu_timing.paired_ms``), FlashMLA too when given. A variant that skips a stage on purpose gives other outputs: the
table says so and times it anyway.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import runpy
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# PTX instructions counted per variant (regular expressions; the plain mbarrier.arrive without the cp.async one).
PTX_COUNTS = {"bar.sync": r"\bbar\.sync\b", "barrier.sync": r"\bbarrier\.sync\b",
              "mbarrier.arrive": r"(?<!cp\.async\.)\bmbarrier\.arrive\b",
              "cp.async.mbarrier.arrive": r"cp\.async\.mbarrier\.arrive\b",
              "mbarrier.try_wait": r"mbarrier\.try_wait\b",
              "wgmma.mma_async": r"wgmma\.mma_async\b", "wgmma.wait_group": r"wgmma\.wait_group\b",
              "cp.async.cg": r"cp\.async\.cg\b",
              "cp.async.bulk.prefetch": r"cp\.async\.bulk\.prefetch\b"}


def ptxas_report(ptx: str) -> str:
    """"registers | spill stores/loads | wgmma serialized" of ``ptx`` by the ptxas that ships with this Triton
    (sm_90a; ``tests.ops.test_gluon_builds.ptxas_info``): the last is ptxas's reason for serializing the kernel's
    wgmma, or "no"."""
    sys.path.insert(0, str(ROOT))
    from tests.ops.test_gluon_builds import ptxas_info
    info = ptxas_info(ptx)
    if info is None:
        return "? | ? | ?"
    return f"{info['registers']} | {info['spill_stores']}/{info['spill_loads']} | {info['serialized'] or 'no'}"


def patched_source(source: str, changes, name: str) -> str:
    for old, new in changes:
        count = source.count(old)
        if count != 1:
            raise SystemExit(f"variant {name!r}: {old[:60]!r}... occurs {count} times in the source, not once")
        source = source.replace(old, new)
    return source


def load_variant(module_name: str, name: str, source: str, folder: Path):
    """``source`` imported as a sibling of ``module_name`` (same package, so relative imports resolve)."""
    package = module_name.rsplit(".", 1)[0]
    safe = re.sub(r"\W", "_", name)
    path = folder / f"{module_name.rsplit('.', 1)[1]}__{safe}.py"
    path.write_text(source)
    full = f"{package}.{path.stem}"
    spec = importlib.util.spec_from_file_location(full, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    spec.loader.exec_module(module)
    return module


def default_inputs(T: int, H: int, device):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sparse_attention import D, make_inputs
    q, kv, idx, sink, _ = make_inputs(T, device, heads=H)
    return dict(q=q, kv=kv, idx=idx, sink=sink.float(), scale=D ** -0.5)


def default_call(module, inp):
    q = inp["q"]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    module.launch_fwd(q, inp["kv"], inp["idx"], inp["sink"], out, lse, inp["scale"])
    return out, lse


def build_row(module, kernel_name: str, new_arguments: dict | None = None, constexprs: dict | None = None) -> str:
    sys.path.insert(0, str(ROOT))
    from tests.ops.test_gluon_builds import compile_sm90, gluon_kernels
    shipped = {fn.__name__: (sig, consts) for _, fn, sig, consts in gluon_kernels()}
    fn = getattr(module, kernel_name)
    signature, shipped_constexprs = shipped[kernel_name]
    constexprs = dict(shipped_constexprs, **(constexprs or {}))
    if new_arguments:       # in the kernel's argument order (its source's names)
        signature = dict(signature, **new_arguments)
        signature = {name: signature[name] for name in fn.arg_names if name in signature}
    kernel = compile_sm90(fn, signature, constexprs)
    ptx = kernel.asm["ptx"]
    counts = [len(re.findall(pattern, ptx)) for pattern in PTX_COUNTS.values()]
    return f"| {ptxas_report(ptx)} | {kernel.metadata.shared} | " + " | ".join(map(str, counts)) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", help="a Python file defining MODULE (optional) and VARIANTS")
    ap.add_argument("--build-only", action="store_true", help="compile each variant for sm_90 offline (no GPU)")
    ap.add_argument("--T", type=int, nargs="+", default=[32768])
    ap.add_argument("--H", type=int, nargs="+", default=[64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--flashmla", default=None, help="folder made by get_flashmla.sh: FlashMLA in the same rounds")
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME",
                    help="these variants only (e.g. one per process under `timeout`: a variant that deadlocks then "
                    "costs only its own run)")
    args = ap.parse_args()
    spec = runpy.run_path(args.variants)
    module_name = spec.get("MODULE", "dsv4attn.ops.sparse_attention.gluon_hopper")
    kernel_name = spec.get("KERNEL", "_sparse_attn_fwd_gluon")
    call, make = spec.get("call", default_call), spec.get("inputs", default_inputs)
    shipped = importlib.import_module(module_name)
    source = Path(shipped.__file__).read_text()
    folder = Path(tempfile.mkdtemp(prefix="kernel_variants_"))
    unknown = sorted(set(args.only or ()) - set(spec["VARIANTS"]))
    if unknown:
        ap.error(f"--only: no variant {unknown} in {args.variants}; it has {sorted(spec['VARIANTS'])}")
    variants = {name: load_variant(module_name, name, patched_source(source, changes, name), folder)
                for name, changes in spec["VARIANTS"].items() if args.only is None or name in args.only}

    if args.build_only:
        import triton
        print(f"{module_name}.{kernel_name}, sm_90 offline, Triton {triton.__version__}")
        forced = spec.get("BUILD_CONSTEXPRS")
        if forced:
            print(f"constexprs set for every row: {forced}")
        print("| variant | registers | spill stores/loads (bytes) | wgmma serialized | shared bytes | "
              + " | ".join(PTX_COUNTS) + " |")
        print("|---" * (5 + len(PTX_COUNTS)) + "|")
        for name, module in [("shipped", shipped)] + list(variants.items()):
            try:
                extra = spec.get("BUILD_SIGNATURE") if module is not shipped else None
                own = dict(forced or {}, **spec.get("VARIANT_CONSTEXPRS", {}).get(name, {}))
                print(f"| {name} " + build_row(module, kernel_name, extra, own), flush=True)
            except Exception as exc:               # one variant's failure does not stop the others
                print(f"| {name} | build failed: {type(exc).__name__}: {str(exc)[-300:]} |", flush=True)
        return

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_timing import paired_ms, start_log
    log = start_log("kernel_variants.py", None)
    flashmla = None
    if args.flashmla:
        sys.path.insert(0, args.flashmla)
        from load_flashmla import load
        flashmla = load(args.flashmla)
    log(f"{module_name}: each variant against the shipped kernel, {args.rounds} alternating rounds (medians)")
    log("| T | H | variant | outputs vs shipped | shipped ms | variant ms | x shipped | FlashMLA ms | x FlashMLA |")
    log("|---|---|---|---|---|---|---|---|---|")
    for T in args.T:
        for H in args.H:
            inp = make(T, H, torch.device("cuda"))
            want = call(shipped, inp)
            run_flashmla = None
            if flashmla is not None and "q" in inp:
                idx = torch.nn.functional.pad(inp["idx"], (0, -inp["idx"].shape[1] % 128), value=-1)[:, None]
                idx = idx.contiguous()

                def run_flashmla():
                    return flashmla.flash_mla_sparse_fwd(inp["q"], inp["kv"][:, None], idx, inp["scale"],
                                                         inp["kv"].shape[1], inp["sink"])
            for name, module in variants.items():
                got = call(module, inp)
                if all(torch.equal(a, b) for a, b in zip(got, want)):
                    diff = "bitwise"
                else:
                    diff = "max abs diff " + ", ".join(
                        f"{(a.float() - b.float()).abs().nan_to_num(0.0).max().item():.2e}" for a, b in zip(got, want))
                base_ms, var_ms, _ = paired_ms(lambda: call(shipped, inp), lambda: call(module, inp), args.rounds)
                peer = "- | -"
                if run_flashmla is not None:
                    mine_ms, fm_ms, _ = paired_ms(lambda: call(module, inp), run_flashmla, args.rounds)
                    peer = f"{fm_ms:.3f} | {fm_ms / mine_ms:.3f}"
                log(f"| {T} | {H} | {name} | {diff} | {base_ms:.3f} | {var_ms:.3f} | {base_ms / var_ms:.3f} | {peer} |")


if __name__ == "__main__":
    main()
