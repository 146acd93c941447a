"""Probe run: correctness of the split-schedule forward against the shipped Gluon forward and float64, then
timing against the shipped kernel and FlashMLA in alternating rounds."""
import importlib, sys, time
import torch
sys.path.insert(0, "benchmarks/variants"); sys.path.insert(0, "benchmarks")
from gpu_timing import paired_ms
import fwd_split_schedule as fwd_split
from dsv4attn.ops.index_sets import Explicit
from dsv4attn.ops.sparse_attention.reference import reference_forward
shipped = importlib.import_module("dsv4attn.ops.sparse_attention.gluon_hopper")
dev = torch.device("cuda")
variants = {"halves_p56": fwd_split.make_launch(True, (216, 56)),
            "halves_p64": fwd_split.make_launch(True, (216, 64)),
            "halves_p72": fwd_split.make_launch(True, (208, 72)),
            "halves_p56_pipe": fwd_split.make_launch(True, (216, 56), pipe=True),
            "halves_p72_pipe": fwd_split.make_launch(True, (208, 72), pipe=True),
            "whole_p56_pipe": fwd_split.make_launch(False, (216, 56), pipe=True)}
MODE = sys.argv[1]
import os
TS = [int(x) for x in os.environ.get('TS', '32768 8192').split()]
HS = [int(x) for x in os.environ.get('HS', '64 128').split()]
if len(sys.argv) > 2:
    variants = {k: v for k, v in variants.items() if k in sys.argv[2:]}


def run(launch, q, kv, idx, sink, scale, rope=None):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    launch(q, kv, idx, sink, out, lse, scale, rope=rope)
    return out, lse


def case(T, H, K, N, seed, holes=0.0, empty_rows=0, rope=False, dtype=torch.bfloat16):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(T, H, 512, device=dev, generator=g).to(dtype)
    kv = torch.randn(N, 512, device=dev, generator=g).to(dtype)
    idx = torch.randint(0, N, (T, K), device=dev, generator=g, dtype=torch.int32)
    lens = torch.randint(0, K + 1, (T,), device=dev, generator=g)
    idx = torch.where(torch.arange(K, device=dev)[None, :] < lens[:, None], idx, -1)
    if holes:
        idx = idx.masked_fill(torch.rand(T, K, device=dev, generator=g) < holes, -1)
    if empty_rows:
        idx[:empty_rows] = -1
    sink = torch.randn(H, device=dev, generator=g) * 3
    tab = None
    if rope:
        ang = torch.rand(T, 32, device=dev, generator=g) * 6
        tab = (ang.cos().contiguous(), ang.sin().contiguous())
    return q, kv, idx.int().contiguous(), sink, tab


if MODE == "check":
  print("correctness (max |diff| vs shipped; vs float64: variant / shipped max err)", flush=True)
  CASES = [(300, 64, 640, 5000, 1, 0.0, 0, False), (257, 128, 576, 3000, 2, 0.3, 5, True),
           (129, 64, 64, 100, 3, 0.5, 3, False), (200, 64, 100, 700, 4, 0.0, 0, True),
           (64, 64, 17, 50, 5, 0.9, 10, False), (100, 128, 1000, 4000, 6, 0.1, 0, False)]
  for (T, H, K, N, seed, holes, er, rope) in CASES:
      q, kv, idx, sink, tab = case(T, H, K, N, seed, holes, er, rope)
      scale = 512 ** -0.5
      want = run(shipped.launch_fwd, q, kv, idx, sink, scale, tab)
      o64, l64 = reference_forward(q.double(), kv.double(), Explicit(idx), sink.double(), scale,
                                   **({} if tab is None else {}))
      for name, launch in variants.items():
          got = run(launch, q, kv, idx, sink, scale, tab)
          d = [(a.float() - b.float()).abs().nan_to_num(0.0).max().item() for a, b in zip(got, want)]
          same_inf = torch.equal(torch.isinf(got[1]), torch.isinf(want[1]))
          msg = (f"T={T} H={H} K={K} holes={holes} empty={er} rope={rope} {name}: out {d[0]:.2e} lse {d[1]:.2e} "
                 f"inf-pattern {same_inf}")
          if tab is None:
              e_v = (got[0].double() - o64).abs().max().item(); e_s = (want[0].double() - o64).abs().max().item()
              msg += f" | vs f64 out {e_v:.2e} / {e_s:.2e}"
          print(msg, flush=True)

if MODE == "check":
    sys.exit(0)
print("\ntiming, K = 640 causal top-k (benchmarks/sparse_attention.make_inputs), 7 alternating rounds", flush=True)
from sparse_attention import make_inputs
sys.path.insert(0, ".peers/flashmla")
fm = None
try:
    from load_flashmla import load
    fm = load(".peers/flashmla")
except Exception as e:
    print("no flashmla:", e)
print("| T | H | variant | shipped ms | variant ms | x shipped | FlashMLA ms | x FlashMLA |")
for T in TS:
    for H in HS:
        q, kv, idx, sink, _ = make_inputs(T, dev, heads=H)
        sink = sink.float(); scale = 512 ** -0.5
        fidx = torch.nn.functional.pad(idx, (0, -idx.shape[1] % 128), value=-1)[:, None].contiguous()
        def flash():
            return fm.flash_mla_sparse_fwd(q, kv[:, None], fidx, scale, 512, sink)
        for name, launch in variants.items():
            a, b, _ = paired_ms(lambda: run(shipped.launch_fwd, q, kv, idx, sink, scale),
                                lambda: run(launch, q, kv, idx, sink, scale), 7)
            peer = "- | -"
            if fm is not None:
                m, f, _ = paired_ms(lambda: run(launch, q, kv, idx, sink, scale), flash, 7)
                peer = f"{f:.3f} | {f / m:.3f}"
            print(f"| {T} | {H} | {name} | {a:.3f} | {b:.3f} | {a / b:.3f} | {peer} |", flush=True)
