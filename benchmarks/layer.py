"""One HybridAttention layer, forward + backward: time, peak memory and a per-op breakdown (one table each).

    python benchmarks/layer.py --preset flash --rows 8192 32768 131072 262144 --ratios 0 4 128 \
        --phases dense warmup sparse [--breakdown] [--backend reference]

Each case runs once to warm up, then once timed (``--rounds R``: R times, medians). A step is timed as a training
step runs it: the batch's pack (``dsv4attn.pack_batch``) is built once per batch, outside the timed step, as a model
builds it once for all its layers; the upstream gradient is drawn once per case and fed to ``y.backward``, so no loss
kernels count as the layer's; the allocator's cache is emptied once per case, before the warm-up run, not before each
timed run (a training loop keeps its cache warm). ``peak reserved`` is the caching allocator's peak (what the process
held from the driver); ``live before`` is the memory still allocated when the case starts (after garbage
collection): the inputs, the upstream gradient and the pack with the layouts it caches (built in the first case's
warm-up run, reused by the later ones); more than that means the previous case leaked. ``doc`` is the document length
(``--doc-len``; the batch is T / doc documents back to back).

``--breakdown`` records the arguments of every op call the timed step makes (compressor pooling, indexer top-k,
sparse attention, indexer KL and its window lse) and replays each call on its own, forward and forward + backward,
median of 3 (the upstream gradient is drawn once, outside the timed runs: drawn inside each, a (T, 64, 512)
gradient's cost counted as the op's). In the warm-up the loss selects the attention's top-k itself
(``indexer_kl(..., select_topk=)``), so its top-k is counted under "indexer KL" and the peers' composite takes no
indexer top-k there. In the sparse phase the KL's teacher mass comes from the attention's backward
(``indexer_kl_from_attention``'s probe): "attention" includes forming it, "indexer KL" is the KL and its gradients
from a given mass (a random non-negative one in the replay).
"q-norm + RoPE" is the elementwise pass over the (T, H, D) queries (the output's inverse RoPE runs inside the
attention). "rest" is the layer's forward + backward minus those ops: the projections, norms, the kv and compressed
RoPE and the output projection.
``--profile N`` runs one more forward + backward of each case under ``torch.profiler`` and prints the N kernels
(or, on the CPU, operators) with the most self time: what "rest" is made of.

``--compile`` adds a row per case for ``torch.compile(layer, fullgraph=True)`` (inductor: the registered Triton ops
stay opaque, the norms, casts and other elementwise code between them are generated), after one compiling run; with
``--rounds R`` the eager and compiled steps alternate R times and the row gives the medians and the median of the
per-round ratios (eager / compiled fwd+bwd time: above 1 means the compiled layer is faster).

``--peers .peers`` (with ``--breakdown``, one document per batch) replays the layer's own op calls through the peers
a Megatron-style Hopper stack would run for them: the attention through FlashMLA's sparse forward and cuDNN
Frontend 1.32's backward (fed FlashMLA's out and lse; the slots padded with -1 to a multiple of 128), the indexer
top-k through cuDNN's SM90 indexer (score matrix + top-k); folders as for benchmarks/sparse_attention.py and
benchmarks/indexer.py (docs/performance.md, "Peers"). The peer table gives each op's time beside ours and the
composite layer: ours with those ops replaced by the peers' times (the KL and the rest stay ours).
"""
from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
from collections import defaultdict

import torch

import dsv4attn
from dsv4attn.layers import attention as attention_module
from dsv4attn.layers import compressor as compressor_module

# (module, name, label): the op entry points the layer calls.
OPS = ((compressor_module, "compress_pool", "compressor pool"), (attention_module, "indexer_topk", "indexer top-k"),
       (attention_module, "sparse_attention", "attention"), (attention_module, "indexer_kl", "indexer KL"),
       (attention_module, "indexer_kl_from_attention", "indexer KL"),
       (attention_module, "sparse_attention_lse", "indexer KL (window LSE)"),
       (attention_module, "qnorm_rope", "q-norm + RoPE"))


class OpRecorder:
    """Wraps the layer's op entry points and keeps (label, function, args, grad mode) of every call."""

    def __init__(self):
        self.calls, self._saved = [], []

    def __enter__(self):
        for module, name, label in OPS:
            fn = getattr(module, name)
            self._saved.append((module, name, fn))

            def wrapper(*args, _fn=fn, _label=label, **kwargs):
                grad = torch.is_grad_enabled()
                self.calls.append((_label, _fn, args, kwargs, grad))
                return _fn(*args, **kwargs)
            setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc):
        for module, name, fn in self._saved:
            setattr(module, name, fn)


def _leaf(a, grad):
    if isinstance(a, torch.Tensor) and a.is_floating_point():
        return a.detach().clone().requires_grad_(grad and a.requires_grad)
    return a


def _time_call(fn, args, kwargs, grad, backward: bool, reps: int = 3) -> float:
    times, upstream = [], None
    for _ in range(reps + 1):
        leaves = [_leaf(a, grad) for a in args]
        # The attention's teacher-mass probe is a leaf of its own here: the replay's backward forms the mass into
        # it (as the layer's does) and stops there.
        named = {k: _leaf(v, grad) for k, v in kwargs.items()}
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.set_grad_enabled(grad):
            out = fn(*leaves, **named)
            if backward and grad:
                first = out[0] if isinstance(out, tuple) else out
                if first.requires_grad:
                    if upstream is None:        # drawn in the untimed first run: its cost is not the op's
                        # 1-D: a loss per row; a probe (the sparse KL's, fp32, expanded from one element): a teacher
                        # mass, which is non-negative; otherwise an output's gradient.
                        upstream = (torch.ones_like(first) if first.dim() == 1 else
                                    torch.rand_like(first) if 0 in first.stride() else torch.randn_like(first))
                    first.backward(upstream)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        del out, leaves, named
    return statistics.median(times[1:])


def breakdown(calls) -> dict[str, tuple[float, float]]:
    """label -> (forward ms, forward + backward ms), summed over the calls with that label."""
    totals = defaultdict(lambda: [0.0, 0.0])
    for label, fn, args, kwargs, grad in calls:
        totals[label][0] += _time_call(fn, args, kwargs, grad, backward=False)
        totals[label][1] += _time_call(fn, args, kwargs, grad, backward=True)
    return {k: tuple(v) for k, v in totals.items()}


def run_case(layer, x, pack, phase, device, upstream, record=False, fresh=False):
    """One forward + backward of ``layer`` on ``x`` with the prebuilt ``pack``; ``upstream`` is dL/dy. ``fresh``
    empties the allocator's cache first (the case's warm-up run)."""
    gib = 2.0 ** 30
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        if fresh:
            torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    live = torch.cuda.memory_allocated() / gib if cuda else float("nan")
    recorder = OpRecorder()
    with recorder if record else _nothing():
        start = time.perf_counter()
        y = layer(x, pack=pack, phase=phase)
        if cuda:
            torch.cuda.synchronize()
        fwd = (time.perf_counter() - start) * 1e3
        y.backward(upstream)
        if cuda:
            torch.cuda.synchronize()
        total = (time.perf_counter() - start) * 1e3
    del y
    x.grad = None
    layer.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() / gib if cuda else float("nan")
    reserved = torch.cuda.max_memory_reserved() / gib if cuda else float("nan")
    return fwd, total, peak, reserved, live, recorder.calls


def profile_case(layer, x, pack, phase, device, upstream, rows: int) -> None:
    """One forward + backward under torch.profiler; prints the ``rows`` entries with the most self device time, then
    the same grouped by input shapes (which tensor each copy, cast or elementwise pass touched)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        run_case(layer, x, pack, phase, device, upstream)
    keys = ("self_device_time_total", "self_cuda_time_total") if device.type == "cuda" else ("self_cpu_time_total",)
    for key in keys:                           # the device key's name changed across PyTorch releases
        try:
            print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70), flush=True)
            print(prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=rows,
                                                                     max_name_column_width=40,
                                                                     max_shapes_column_width=90), flush=True)
            return
        except (AttributeError, KeyError):
            continue


class Peers:
    """FlashMLA's forward, cuDNN's backward and cuDNN's indexer, loaded from ``folder`` (module docstring)."""

    def __init__(self, folder: str):
        import sys
        sys.path.insert(0, f"{folder}/flashmla")
        sys.path.insert(0, f"{folder}/cudnn_b")
        from load_cudnn_dsa import load as load_cudnn
        from load_flashmla import load as load_flashmla
        self.flashmla = load_flashmla(f"{folder}/flashmla")
        self.cudnn_bwd = load_cudnn(f"{folder}/cudnn_b")
        from cudnn.deepseek_sparse_attention.indexer_forward.api import indexer_forward_wrapper
        from cudnn.deepseek_sparse_attention.indexer_top_k.api import indexer_top_k_wrapper
        self.indexer_scores, self.indexer_top_k = indexer_forward_wrapper, indexer_top_k_wrapper

    def attention(self, q, kv, indices, sinks, scale):
        """(forward ms, forward + backward ms) of FlashMLA's forward then cuDNN's backward on the layer's call."""
        from dsv4attn.ops.index_sets import IndexSet
        idx = (indices.materialize() if isinstance(indices, IndexSet) else indices).to(torch.int32)
        pad = -idx.shape[1] % 128                      # FlashMLA takes K in multiples of 128 on SM90
        idx = torch.nn.functional.pad(idx, (0, pad), value=-1).contiguous()
        q, kv, sinks = q.detach(), kv.detach().to(q.dtype), sinks.detach().float()

        def forward():
            return self.flashmla.flash_mla_sparse_fwd(q, kv[:, None], idx[:, None], scale, kv.shape[1], sinks)

        out, _, lse = forward()
        dout = torch.randn_like(out)
        fwd = _time_call(forward, (), {}, False, backward=False)
        bwd = _time_call(lambda: self.cudnn_bwd(q, kv, out, dout, lse, sinks, idx, softmax_scale=scale), (), {},
                         False, backward=False)
        return fwd, fwd + bwd

    def indexer(self, index_q, index_k, index_w, candidates, topk):
        """Forward ms of cuDNN's score matrix + top-k on the layer's call (no backward: top-k has no gradient)."""
        layout = candidates
        while not hasattr(layout, "layout"):           # Rows wrappers of the frame around VisibleCompressed
            layout = layout.base
        seq_lens = layout.layout.row_visible.to(torch.int32)
        q4, k4, w3 = index_q.detach()[None], index_k.detach()[None, :, None], index_w.detach()[None].float()

        def run():
            scores = self.indexer_scores(q4, k4, w3, ratio=4, sm_scale=1.0)["scores"][0]
            return self.indexer_top_k(scores, seq_lens, topk, tie_break=1)["indices"]

        ms = _time_call(run, (), {}, False, backward=False)
        return ms, ms


def peer_breakdown(calls, peers: Peers) -> dict[str, tuple[float, float]]:
    """label -> the peers' (forward ms, forward + backward ms) for the op calls they can run, summed per label."""
    totals = defaultdict(lambda: [0.0, 0.0])
    for label, fn, args, kwargs, grad in calls:
        if label == "attention":
            times = peers.attention(*args[:5])
        elif label == "indexer top-k":
            times = peers.indexer(*args[:5])
        else:
            continue
        totals[label][0] += times[0]
        totals[label][1] += times[1]
    return {k: tuple(v) for k, v in totals.items()}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="flash", choices=["tiny", "flash", "pro"])
    ap.add_argument("--rows", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--ratios", type=int, nargs="+", default=[0, 4, 128])
    ap.add_argument("--phases", nargs="+", default=["sparse"])
    ap.add_argument("--doc-len", type=int, default=0, help="0: one document spanning the batch")
    ap.add_argument("--breakdown", action="store_true", help="also time every op call of the step on its own")
    ap.add_argument("--backend", default="auto", choices=["auto", "reference", "triton"])
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also profile one step per case and print its N most expensive kernels")
    ap.add_argument("--compile", action="store_true", help="also run each case through torch.compile(layer, "
                    "fullgraph=True) (inductor): a second row, phase marked 'compiled'")
    ap.add_argument("--rounds", type=int, default=1, help="timed runs per case (medians); with --compile the eager "
                    "and compiled steps alternate")
    ap.add_argument("--peers", default=None, help="folder of the peers (e.g. .peers; with --breakdown, one document): "
                    "FlashMLA, cuDNN's backward and indexer in place of ours, op by op")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.breakdown and device.type != "cuda":
        raise SystemExit("--breakdown needs a CUDA device")
    if args.compile and args.breakdown:
        ap.error("--compile times the compiled layer whole: leave --breakdown out")
    if args.peers and not (args.breakdown and args.doc_len == 0):
        ap.error("--peers needs --breakdown and one document per batch (leave --doc-len out)")
    peers = Peers(args.peers) if args.peers else None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = getattr(dsv4attn.AttentionConfig, args.preset)()
    dsv4attn.set_checks(False)
    dsv4attn.set_backend(args.backend)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{args.preset} geometry, {dtype}, {name}, backend {args.backend}")
    print("| T | doc | ratio | phase | fwd ms | fwd+bwd ms | peak GiB | peak reserved GiB | live before GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    details = []
    for T in args.rows:
        doc = args.doc_len or T
        cu = torch.tensor([0] + [doc] * (T // doc), dtype=torch.int32, device=device).cumsum(0).to(torch.int32)
        pack = dsv4attn.pack_batch(cu, T, doc)          # once per batch, as a model builds it for all its layers
        for ratio in args.ratios:
            layer = dsv4attn.HybridAttention(cfg, ratio).to(device=device, dtype=dtype).train()
            for phase in args.phases:
                if ratio != 4 and phase != args.phases[0]:
                    continue                                   # the phase only changes ratio-4 layers
                x = torch.randn(T, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
                upstream = torch.randn_like(x)                 # dL/dy, drawn once: y has x's shape
                step = functools.partial(run_case, x=x, pack=pack, phase=phase, device=device, upstream=upstream)
                try:
                    step(layer, fresh=True)
                    fwd, total, peak, reserved, live, calls = step(layer, record=args.breakdown)
                    if args.rounds > 1 and not args.compile:      # with --compile the rounds alternate below
                        runs = [(fwd, total)] + [step(layer)[:2] for _ in range(args.rounds - 1)]
                        fwd, total = (statistics.median(r[i] for r in runs) for i in range(2))
                except torch.OutOfMemoryError:
                    print(f"| {T} | {doc} | {ratio} | {phase} | OOM | OOM | - | - | - |", flush=True)
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                print(f"| {T} | {doc} | {ratio} | {phase} | {fwd:.1f} | {total:.1f} | {peak:.1f} | {reserved:.1f} | "
                      f"{live:.2f} |", flush=True)
                if args.breakdown:
                    details.append((T, ratio, phase, fwd, total, breakdown(calls),
                                    peer_breakdown(calls, peers) if peers else {}))
                    del calls
                if args.profile:
                    profile_case(layer, x, pack, phase, device, upstream, args.profile)
                if args.compile:
                    compiled = torch.compile(layer, fullgraph=True)
                    step(compiled, fresh=True)                                   # compiles
                    fwd, total, peak, reserved, live, _ = step(compiled)
                    if args.rounds > 1:
                        eager, comp = [], [(fwd, total)]
                        for _ in range(args.rounds):
                            eager.append(step(layer)[:2])
                            comp.append(step(compiled)[:2])
                        med = lambda runs, i: statistics.median(r[i] for r in runs)      # noqa: E731
                        ratio_t = statistics.median(e[1] / k[1] for e, k in zip(eager, comp[1:]))
                        print(f"| {T} | {doc} | {ratio} | {phase} (eager, {args.rounds} alternating rounds) | "
                              f"{med(eager, 0):.1f} | {med(eager, 1):.1f} | - | - | - |", flush=True)
                        fwd, total = med(comp[1:], 0), med(comp[1:], 1)
                        phase_label = f"{phase} (compiled, eager / compiled = {ratio_t:.3f})"
                    else:
                        phase_label = f"{phase} (compiled)"
                    print(f"| {T} | {doc} | {ratio} | {phase_label} | {fwd:.1f} | {total:.1f} | {peak:.1f} | "
                          f"{reserved:.1f} | {live:.2f} |", flush=True)
                    if args.profile:
                        print(f"\nProfile of the compiled layer, ratio {ratio}, {phase}:", flush=True)
                        profile_case(compiled, x, pack, phase, device, upstream, args.profile)
                    del compiled
            del layer
    if details:
        print("\nPer-op breakdown (each op call replayed alone; ms forward / forward+backward)")
        labels = ["compressor pool", "indexer top-k", "attention", "indexer KL", "indexer KL (window LSE)",
                  "q-norm + RoPE"]
        print("| T | ratio | phase | " + " | ".join(labels) + " | rest (proj, norms, kv RoPE, output) | layer |")
        print("|---|---|---|" + "---|" * (len(labels) + 2))
        for T, ratio, phase, fwd, total, parts, _ in details:
            cells = [f"{parts[k][0]:.1f} / {parts[k][1]:.1f}" if k in parts else "-" for k in labels]
            rest_f = fwd - sum(v[0] for v in parts.values())
            rest_t = total - sum(v[1] for v in parts.values())
            print(f"| {T} | {ratio} | {phase} | " + " | ".join(cells) +
                  f" | {rest_f:.1f} / {rest_t:.1f} | {fwd:.1f} / {total:.1f} |")
    if peers is not None and details:
        print("\nPeers op by op (ms forward / forward+backward; ours / peer) and the composite layer: ours with the "
              "attention and the indexer top-k taken at the peers' times")
        print("| T | ratio | phase | attention: ours | FlashMLA + cuDNN | indexer top-k: ours | cuDNN indexer | "
              "layer: ours | composite | x composite |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for T, ratio, phase, fwd, total, parts, peer in details:
            def cell(d, k):
                return f"{d[k][0]:.1f} / {d[k][1]:.1f}" if k in d else "-"
            comp_f = fwd - sum(parts[k][0] - peer[k][0] for k in peer)
            comp_t = total - sum(parts[k][1] - peer[k][1] for k in peer)
            print(f"| {T} | {ratio} | {phase} | {cell(parts, 'attention')} | {cell(peer, 'attention')} | "
                  f"{cell(parts, 'indexer top-k')} | {cell(peer, 'indexer top-k')} | {fwd:.1f} / {total:.1f} | "
                  f"{comp_f:.1f} / {comp_t:.1f} | {comp_t / total:.2f} |")


if __name__ == "__main__":
    main()
