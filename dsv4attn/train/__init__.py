"""The main job: train a small decoder LM built from dsv4attn layers (``python -m dsv4attn.train``).

- ``model.py``      DecoderLM: embedding, blocks of RMSNorm -> HybridAttention -> RMSNorm -> SwiGLU, head
- ``data.py``       built-in long-range retrieval task and byte-level text, packed into THD batches
- ``config.py``     TrainConfig: options, validation, phase curriculum, LR schedule
- ``loop.py``       the training loop (devices, torchrun data/context parallelism, resume, eval, checkpoints)
- ``distributed.py`` data x context parallel layout: process groups, this rank's rows, gradient reduction
- ``evaluate.py``   held-out LM loss, retrieval accuracy, indexer loss and recall@k
- ``checkpoint.py`` safetensors weights + JSON metadata + checksum manifest: crash-safe saves, verified loads
- ``report.py``     curves.png and the end-of-run summary
- ``cli.py``        argument parsing
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
