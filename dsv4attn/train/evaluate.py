"""Held-out evaluation: LM loss, retrieval accuracy, indexer loss and indexer recall@k.

The indexer metrics come from a probe of each ratio-4 layer on its captured input (the model runs in eval mode
under ``no_grad``, where the layers compute no indexer loss). The probe takes the layer's single-device queries,
compressed entries and indexer outputs from ``HybridAttention.indexer_inputs``, then measures:

- **recall@k**: for every query row with more than k visible compressed entries (where selection matters), the
  share of the teacher's top-k that the indexer's top-k also holds. The teacher ranks entries by the main
  attention's head-summed probability over *all* visible entries with the full denominator (window + sink +
  compressed; docs/semantics.md, decision 7), ties to the lower index like the indexer (docs/semantics.md, decision 6).
- **indexer loss**: ``coeff * sum_t KL_t / real rows`` exactly as the layer defines it, with the dense teacher in
  the dense and warm-up phases and the sparse one (the indexer's own top-k) in the sparse phase. (In the dense
  phase the layer itself reports 0 because its indexer is idle; the probe still shows how far it is.)
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from ..layers import HybridAttention
from ..layers.common import is_sharded
from ..ops import indexer_kl, indexer_topk
from ..ops.index_sets import Explicit, VisibleCompressed, chunk_rows
from ..packing import pack_batch
from ..parallel import unshard
from .data import Batch
from .distributed import local_rows, sum_over
from .model import DecoderLM, lm_loss


@torch.no_grad()
def probe_indexer(layer: HybridAttention, x: torch.Tensor, pack, phase: str) -> dict:
    """Indexer metrics of one ratio-4 ``layer`` on its input ``x`` (T, hidden) of the packed batch ``pack``.

    Returns sums (so batches and layers add up): ``kl`` (coeff * sum_t KL_t), ``hits`` and ``wanted`` (recall
    numerator and denominator over rows with more than k visible entries).
    """
    c, T, k = layer.config, x.shape[0], layer.config.index_topk
    seen = layer.indexer_inputs(x, pack)
    q, compressed, outside_lse, layout = seen["q"], seen["compressed"], seen["outside_lse"], seen["layout"]
    index_q, index_k, index_w = seen["index_q"], seen["index_k"], seen["index_weights"]
    student = indexer_topk(index_q, index_k, index_w, layout, k)                     # (T, k') best first
    visible = VisibleCompressed(layout, T)
    teacher = _teacher_topk(q, compressed, outside_lse, visible, student.shape[1], c.softmax_scale)

    candidates = Explicit(student, bound=index_k.shape[0]) if phase == "sparse" else visible
    kl = indexer_kl(index_q, index_k, index_w, q, compressed, candidates, outside_lse, c.softmax_scale)

    hard = layout.row_visible > k                                                    # rows where selection matters
    t_valid = (teacher >= 0) & hard[:, None]
    same = (teacher[:, :, None] == student[:, None, :]) & (student[:, None, :] >= 0)
    hits = (same.any(-1) & t_valid).sum()
    return {"kl": float(c.indexer_loss_coeff * kl.sum()), "hits": int(hits), "wanted": int(t_valid.sum())}


def _teacher_topk(q, compressed, outside_lse, visible, width, scale):
    """(T, width) int32 visible entries with the largest head-summed attention probability, -1 padded."""
    T = q.shape[0]
    out = torch.full((T, width), -1, dtype=torch.int32, device=q.device)
    if width == 0:
        return out
    cd = torch.promote_types(q.dtype, torch.float32)
    for s, e in chunk_rows(T, visible.width * q.shape[1]):
        cand = visible.rows(s, e)
        valid = cand >= 0
        logits = torch.einsum("chd,ckd->chk", q[s:e].to(cd), compressed[cand.clamp(min=0)].to(cd)) * scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        denom = torch.logaddexp(outside_lse[s:e].to(cd), torch.logsumexp(logits, dim=-1))   # full denominator
        mass = torch.exp(logits - denom[..., None]).sum(dim=1).masked_fill(~valid, float("-inf"))
        order = torch.sort(mass, dim=-1, descending=True, stable=True).indices[:, :width]
        chosen = torch.where(valid.gather(1, order), cand.gather(1, order), torch.full_like(order, -1))
        out[s:e] = chosen.to(torch.int32)
    return out


@torch.no_grad()
def evaluate(model: DecoderLM, batches: list[Batch], phase: str, device: torch.device, autocast=None,
             cp_group=None, cp_partition: str = "contiguous", cp_compressed: str = "gather") -> dict:
    """Metrics of ``model`` on held-out ``batches`` in ``phase``; None where a metric does not apply (no answer
    rows in the data, no ratio-4 layer, or no row with more than k visible entries).

    With ``cp_group`` (and ``cp_partition``, ``cp_compressed``) every rank of the group calls it with the same
    batches: the model runs context-parallel, the LM sums are added up over the group, and each rank probes the
    indexer on the gathered attention inputs of the whole batch (one layer at a time, without autograd). Every rank
    returns the same metrics.
    """
    was_training = model.training
    model.eval()
    targets = answers = rows = 0
    sums = torch.zeros(2, dtype=torch.float64, device=device)      # cross-entropy sum, correct answers
    probe = {"kl": 0.0, "hits": 0, "wanted": 0}
    has_indexer = any(l.indexer is not None for l in model.attention_layers())
    try:
        for batch in batches:
            b = batch.to(device)
            captured = [] if has_indexer else None
            with autocast or nullcontext():
                logits = model(b.tokens, b.cu_seqlens, b.max_seqlen, phase, captured=captured, cp_group=cp_group,
                               cp_partition=cp_partition, cp_compressed=cp_compressed)
                rows_targets = local_rows(b.targets, cp_group, cp_partition)
                sums[0] += lm_loss(logits, rows_targets, 1).double()         # a sum: divided once at the end
                if b.num_answers:
                    is_answer = local_rows(b.answer_mask, cp_group, cp_partition)
                    sums[1] += (logits.argmax(-1)[is_answer] == rows_targets[is_answer]).sum()
                targets += b.num_targets                                   # host counts of the whole batch
                answers += b.num_answers
                rows += b.num_tokens
                if captured:
                    pack = pack_batch(b.cu_seqlens, b.tokens.shape[0], b.max_seqlen)
                    for layer, x in captured:
                        if layer.indexer is not None:
                            x = x if cp_group is None else unshard(x, cp_group, cp_partition)
                            # The probe reads the layer outside its forward: under FSDP2 gather it first
                            # (collective: every rank probes the same layers).
                            with _gathered(layer):
                                for key, v in probe_indexer(layer, x, pack, phase).items():
                                    probe[key] += v
    finally:
        model.train(was_training)
    loss_sum, correct = sum_over(sums, cp_group).tolist()
    return {
        "lm_loss": loss_sum / max(targets, 1),
        "retrieval_acc": correct / answers if answers else None,
        "answers": int(answers),
        # summed over layers, per real token: the normalisation of the layers' own indexer_loss
        "indexer_loss": probe["kl"] / rows if has_indexer and rows else None,
        "indexer_recall": probe["hits"] / probe["wanted"] if probe["wanted"] else None,
    }


def _gathered(layer):
    if not any(is_sharded(p) for p in layer.parameters()):
        return nullcontext()
    from ..parallel.fsdp import gathered
    return gathered(layer)


class Evaluator:
    """Held-out evaluation of a run: every ``eval_every`` steps and after the session's last step, on replica 0's
    ranks only (``active``), logged to ``run`` and shown through ``say`` (rank 0 prints).

    ``batches`` are built once (the same held-out batches at every evaluation); ``last`` holds the newest metrics.
    """

    def __init__(self, model: DecoderLM, batches: list[Batch], every: int, end: int, device, autocast, par,
                 cp_partition: str, run, say, active: bool, cp_compressed: str = "gather"):
        self.model, self.batches, self.every, self.end = model, batches, every, end
        self.device, self.autocast, self.cp_group, self.cp_partition = device, autocast, par.cp_group, cp_partition
        self.run, self.say, self.active, self.cp_compressed = run, say, active, cp_compressed
        self.last: dict | None = None

    def _evaluate(self, phase: str) -> dict:
        self.last = evaluate(self.model, self.batches, phase, self.device, self.autocast, self.cp_group,
                             self.cp_partition, self.cp_compressed)
        return self.last

    def maybe_run(self, done: int, phase: str) -> dict | None:
        """Evaluate after ``done`` steps (the last of them in ``phase``) if it is due; returns the metrics."""
        if not self.active or not (done % self.every == 0 or done == self.end):
            return None
        metrics = self._evaluate(phase)
        self.run.log({"kind": "eval", "step": done, "phase": phase, **metrics})
        self.say(eval_line(done, phase, metrics))
        return metrics

    def final(self, done: int, phase: str) -> dict | None:
        """The metrics for the summary: the newest of this session, or (a session that ran no step: resumed at or
        past the end) the model's now, logged unless the run's log holds that step's evaluation already."""
        if self.active and self.last is None:
            self._evaluate(phase)
            if done not in self.run.logged_evals:
                self.run.log({"kind": "eval", "step": done, "phase": phase, **self.last})
        return self.last


def eval_line(step: int, phase: str, m: dict) -> str:
    """One screen line of an evaluation's metrics."""
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    return (f"eval @ {step} ({phase}): lm_loss {m['lm_loss']:.4f}  retrieval_acc {fmt(m['retrieval_acc'], '.3f')}  "
            f"indexer_loss {fmt(m['indexer_loss'], '.5f')}  recall@k {fmt(m['indexer_recall'], '.3f')}")
