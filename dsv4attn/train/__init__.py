"""The main job: train a small decoder LM built from dsv4attn layers (``python -m dsv4attn.train``).

- ``model.py``      DecoderLM: embedding, blocks of RMSNorm -> HybridAttention -> RMSNorm -> SwiGLU, head
- ``data.py``       built-in long-range retrieval task and byte-level text, packed into THD batches
- ``config.py``     TrainConfig: options (with their help), validation, phase curriculum, LR schedule
- ``loop.py``       train(): wires setup, step, evaluator and checkpointer into the loop, then the summary
- ``setup.py``      devices, process groups, run folder, model, optimizer, resume point, data
- ``step.py``       one training step (forward, backward, clip, finite check, optimizer step) and its metrics
- ``distributed.py`` data x context parallel layout: process groups, this rank's rows, gradient reduction
- ``evaluate.py``   held-out LM loss, retrieval accuracy, indexer loss and recall@k; the Evaluator
- ``checkpointer.py`` when a run saves and what it resumes from
- ``checkpoint.py`` safetensors weights + JSON metadata + checksum manifest: crash-safe saves, verified loads
- ``run_folder.py`` the --out folder: which files are the trainer's, --overwrite, the metrics.jsonl log
- ``report.py``     throughput, curves.png and the end-of-run summary
- ``cli.py``        argument parsing, generated from TrainConfig's fields
"""
from .config import TrainConfig
from .model import DecoderLM, ModelConfig, model_config

__all__ = ["TrainConfig", "DecoderLM", "ModelConfig", "model_config", "train", "main"]


def train(cfg: TrainConfig) -> dict:
    """Run or resume training as ``cfg`` says (see :func:`dsv4attn.train.loop.train`)."""
    from .loop import train as _train
    return _train(cfg)


def main(argv=None) -> int:
    from .cli import main as _main
    return _main(argv)
