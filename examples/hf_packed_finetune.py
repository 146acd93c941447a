"""Fine-tune a small random transformers DeepseekV4ForCausalLM on packed text, its attention run by dsv4attn.

    python examples/hf_packed_finetune.py                  # plain PyTorch loop, CPU, about a minute
    python examples/hf_packed_finetune.py --trainer        # the same with transformers' Trainer (needs accelerate)

Documents are the paragraphs of this repository's Markdown files (or of ``--text FILE``), byte-level tokens.
Each step packs a batch of documents into one padding-free row with transformers' ``DataCollatorWithFlattening``
(``position_ids`` restarting at 0 at each document, labels -100 at each document start), which the patched model
computes document by document. The attention phase follows dsv4attn's curriculum: ``dense`` for the first 40% of
the steps, ``warmup`` for the next 20% (the indexer learns), then ``sparse`` (top-k). The indexer loss is part of
the backward already (it rides in the attention outputs' backward); it is printed next to the language-model loss.

Prints the loss every ``--log-every`` steps and, at the end, the held-out loss before and after training.
"""
from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch

from dsv4attn.integrations import transformers as dsv4_hf

try:
    import transformers
except ImportError as err:  # pragma: no cover
    raise SystemExit("this example needs transformers: pip install 'dsv4attn[hf]'") from err


def documents(text_path: str | None, min_bytes: int = 8, max_bytes: int = 400) -> list[list[int]]:
    """Byte-level token lists: paragraphs (cut to ``max_bytes``) of ``text_path`` or the repo's Markdown files."""
    if text_path is not None:
        sources = [Path(text_path)]
    else:
        root = Path(__file__).resolve().parents[1]
        sources = sorted([root / "README.md", *(root / "docs").glob("*.md")])
    docs = []
    for path in sources:
        if not path.is_file():
            continue
        for para in path.read_text(encoding="utf-8").split("\n\n"):
            data = para.strip().encode("utf-8")
            for start in range(0, len(data), max_bytes):
                piece = list(data[start:start + max_bytes])
                if len(piece) >= min_bytes:
                    docs.append(piece)
    if len(docs) < 20:
        raise SystemExit(f"too little text in {[str(s) for s in sources]}: pass --text FILE (UTF-8)")
    return docs


def small_config(seed: int) -> transformers.DeepseekV4Config:
    """A ~1M-parameter DeepseekV4 with layers window / CSA / HCA / CSA (ratios 0, 4, 128, 4) and 4 experts."""
    torch.manual_seed(seed)
    return transformers.DeepseekV4Config(
        vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        head_dim=64, partial_rotary_factor=0.25, q_lora_rank=64, o_groups=2, o_lora_rank=32, sliding_window=32,
        index_n_heads=8, index_head_dim=32, index_topk=8, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=128, hc_mult=2, hc_sinkhorn_iters=5,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["moe"] * 4,            # hash-routed MoE needs a trained token->expert table
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def phase_at(step: int, steps: int) -> str:
    """dsv4attn's curriculum: dense 40%, warm-up 20%, sparse the rest."""
    if step < int(0.4 * steps):
        return "dense"
    return "warmup" if step < int(0.6 * steps) else "sparse"


def batches(docs: list[list[int]], tokens: int, rng: random.Random):
    """Endless lists of documents of about ``tokens`` tokens (shuffled each pass)."""
    while True:
        order = list(range(len(docs)))
        rng.shuffle(order)
        batch, size = [], 0
        for i in order:
            batch.append({"input_ids": docs[i]})
            size += len(docs[i])
            if size >= tokens:
                yield batch
                batch, size = [], 0


@torch.no_grad()
def held_out_loss(model, collator, docs) -> float:
    """Mean next-token loss over ``docs`` (one packed row)."""
    was_training = model.training
    model.eval()
    batch = collator([{"input_ids": d} for d in docs])
    loss = model(**batch).loss.item()
    model.train(was_training)
    return loss


def plain_loop(model, collator, train_docs, args) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    stream = batches(train_docs, args.tokens, random.Random(args.seed))
    losses, start = [], time.time()
    for step in range(args.steps):
        phase = phase_at(step, args.steps)
        if step == 0 or phase != phase_at(step - 1, args.steps):
            dsv4_hf.set_phase(model, phase)
        batch = collator(next(stream))
        loss = model(**batch).loss
        loss.backward()                       # also trains the indexer: its KL loss rides in the outputs' backward
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps - 1:
            index = dsv4_hf.indexer_loss(model)
            print(f"step {step:4d}  {phase:6s}  tokens {batch['input_ids'].shape[1]:5d}  loss {loss.item():.3f}  "
                  f"indexer loss {index.item():.4f}  ({time.time() - start:.0f} s)", flush=True)
    return losses


def trainer_loop(model, collator, train_docs, args) -> list[float]:
    """The same run through transformers.Trainer: one packed row per step (``--docs-per-step`` documents)."""
    class Curriculum(transformers.TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):
            dsv4_hf.set_phase(model, phase_at(state.global_step, args.steps))

        def on_log(self, targs, state, control, logs=None, **kw):
            index = dsv4_hf.indexer_loss(model)
            if logs is not None and index is not None:
                logs["indexer_loss"] = round(index.item(), 5)   # the value of the last step (after its backward)

    per_step = max(1, round(args.tokens / (sum(map(len, train_docs)) / len(train_docs))))
    targs = transformers.TrainingArguments(
        output_dir=args.trainer_dir, max_steps=args.steps, per_device_train_batch_size=per_step,
        learning_rate=args.lr, warmup_steps=10, lr_scheduler_type="cosine", weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=args.log_every, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
        dataloader_drop_last=True, seed=args.seed, remove_unused_columns=False)
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=[{"input_ids": d} for d in train_docs],
                                   data_collator=collator, callbacks=[Curriculum()])
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--tokens", type=int, default=1024, help="about this many tokens per packed row (one step)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--text", default=None, help="a UTF-8 text file (default: this repository's Markdown files)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trainer", action="store_true", help="use transformers.Trainer (needs accelerate)")
    p.add_argument("--trainer-dir", default="runs/hf_packed_finetune", help="Trainer's output_dir")
    args = p.parse_args(argv)

    docs = documents(args.text)
    random.Random(args.seed).shuffle(docs)
    held_out, train_docs = docs[:16], docs[16:]
    model = transformers.DeepseekV4ForCausalLM(small_config(args.seed))
    dsv4_hf.apply(model, phase="dense")
    collator = transformers.DataCollatorWithFlattening()      # input_ids, labels, position_ids: one row
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{len(train_docs)} training documents ({sum(map(len, train_docs))} tokens), {n_params / 1e6:.2f}M "
          f"parameters, {args.steps} steps of ~{args.tokens} tokens")
    before = held_out_loss(model, collator, held_out)
    losses = (trainer_loop if args.trainer else plain_loop)(model, collator, train_docs, args)
    after = held_out_loss(model, collator, held_out)
    k = max(1, len(losses) // 10)
    print(f"training loss: first {sum(losses[:k]) / k:.3f} -> last {sum(losses[-k:]) / k:.3f} (means of {k}); "
          f"held-out loss {before:.3f} -> {after:.3f} (uniform over bytes: {math.log(256):.3f})")


if __name__ == "__main__":
    main()
