"""End-of-run report: a PNG of the curves (matplotlib, Agg backend) and a one-screen text summary."""
from __future__ import annotations

import json
import time
from pathlib import Path

from .checkpoint import atomic_write_text

PHASE_COLOURS = {"dense": "#dfe9f5", "warmup": "#fbe8d0", "sparse": "#e0f0dc"}


def read_metrics(path: Path) -> dict[str, list[dict]]:
    """JSONL records grouped by kind; for a step logged twice (a resumed run re-did it) the last record wins."""
    by_kind: dict[str, dict[int, dict]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                rec = json.loads(line)
                by_kind.setdefault(rec.get("kind", "?"), {})[rec.get("step", 0)] = rec
    return {kind: [recs[s] for s in sorted(recs)] for kind, recs in by_kind.items()}


def plot_curves(metrics_path: Path, png_path: Path, cfg, topk: int) -> Path:
    """Four panels (LM loss, retrieval accuracy, indexer loss, indexer recall@k) over steps, phases shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = read_metrics(metrics_path)
    train, evals = m.get("train", []), m.get("eval", [])
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    panels = [
        (axes[0, 0], "LM loss (nats/token)", [("train", train, "loss"), ("held-out", evals, "lm_loss")]),
        (axes[0, 1], "retrieval accuracy (held-out)", [("held-out", evals, "retrieval_acc")]),
        (axes[1, 0], "indexer loss (sum over CSA layers)", [("train", train, "indexer_loss"),
                                                             ("held-out", evals, "indexer_loss")]),
        (axes[1, 1], f"indexer recall@{topk} vs teacher top-{topk} (held-out)",
         [("held-out", evals, "indexer_recall")]),
    ]
    for ax, title, series in panels:
        _shade_phases(ax, cfg)
        for label, recs, key in series:
            pts = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
            if pts:
                xs, ys = zip(*pts)
                style = dict(lw=0.8, alpha=0.6) if label == "train" else dict(marker="o", ms=3, lw=1.5)
                ax.plot(xs, ys, label=label, **style)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_xlim(0, cfg.steps)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not applicable to this run", ha="center", va="center", transform=ax.transAxes)
    axes[0, 0].set_yscale("log")
    axes[0, 1].set_ylim(0, 1)
    axes[1, 1].set_ylim(0, 1)
    fig.suptitle(f"dsv4attn.train  ratios={','.join(map(str, cfg.ratios))}  "
                 f"(shading: dense / warm-up / sparse)", fontsize=11)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def _shade_phases(ax, cfg) -> None:
    bounds = [("dense", 0, cfg.dense_steps), ("warmup", cfg.dense_steps, cfg.dense_steps + cfg.warmup_steps),
              ("sparse", cfg.dense_steps + cfg.warmup_steps, cfg.steps)]
    for phase, lo, hi in bounds:
        if hi > lo:
            ax.axvspan(lo, hi, color=PHASE_COLOURS[phase], zorder=0)


def summary_text(s: dict) -> str:
    """The one-screen summary printed at the end of a run."""
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    e = s["final_eval"]
    sch = s["schedule"]
    lines = [
        "=" * 72,
        (f"dsv4attn.train finished: {s['steps']} steps" if s["done"] >= s["steps"] else
         f"dsv4attn.train stopped at step {s['done']} of {s['steps']} (continue with --resume {s['out']})")
        + f" (this session {s['steps_this_session']}), ratios {','.join(map(str, s['ratios']))}",
        f"  schedule         dense {sch['dense']}  ->  warm-up {sch['warmup']}  ->  sparse {sch['sparse']}",
        f"  model            {s['params']:,} parameters on {s['device']} x {s['world_size']}"
        + (f" (context parallel x {s['cp']})" if s.get("cp", 1) > 1 else ""),
        f"  time             {s['wall_time_s']:.1f} s wall, {s['train_time_s']:.1f} s in training steps",
        f"  throughput       {fmt(s['tokens_per_s'], ',.0f')} tokens/s ({s['tokens']:,} tokens this session)",
        "  held-out eval at the last step:",
        f"    LM loss            {e['lm_loss']:.4f} nats/token",
        f"    retrieval accuracy {fmt(e['retrieval_acc'], '.3f')}  ({e['answers']} answers)",
        f"    indexer loss       {fmt(e['indexer_loss'], '.5f')}",
        f"    indexer recall@k   {fmt(e['indexer_recall'], '.3f')}",
        f"  outputs          {s['out']}/  (metrics.jsonl, summary.txt, checkpoints/"
        + (", curves.png)" if s.get("plot") else ")"),
        "=" * 72,
    ]
    return "\n".join(lines) + "\n"


class Throughput:
    """Time and tokens of this session's training steps: totals for the summary, a smoothed rate for the bar."""

    def __init__(self, start_step: int):
        self.start_step, self.wall_start = start_step, time.perf_counter()
        self.train_time_s, self.tokens, self.rate = 0.0, 0, None

    def add(self, tokens: int, seconds: float) -> None:
        self.train_time_s += seconds
        self.tokens += tokens
        now = tokens / seconds
        self.rate = now if self.rate is None else 0.9 * self.rate + 0.1 * now


def write_summary(out: Path, cfg, mcfg, device, world: int, meter: Throughput, last_eval: dict, params: int,
                  done: int) -> dict:
    """Write curves.png (unless --no-plot), summary.txt and summary.json into ``out``, print the summary (rank 0)
    and return it as a dict."""
    summary = {
        "out": str(out), "steps": cfg.steps, "done": done, "steps_this_session": done - meter.start_step,
        "ratios": list(cfg.ratios), "device": str(device), "world_size": world, "cp": cfg.cp, "tp": cfg.tp,
        "params": params,
        "wall_time_s": time.perf_counter() - meter.wall_start, "train_time_s": meter.train_time_s,
        "tokens": meter.tokens, "tokens_per_s": meter.tokens / meter.train_time_s if meter.train_time_s else None,
        "final_eval": last_eval, "schedule": {"dense": cfg.dense_steps, "warmup": cfg.warmup_steps,
                                              "sparse": cfg.steps - cfg.dense_steps - cfg.warmup_steps},
    }
    if cfg.plot:
        summary["plot"] = str(plot_curves(out / "metrics.jsonl", out / "curves.png", cfg,
                                          mcfg.attention.index_topk))
    text = summary_text(summary)
    atomic_write_text(out / "summary.txt", text)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))
    print(text, flush=True)
    return summary
