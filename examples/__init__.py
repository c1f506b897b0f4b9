"""Examples: a tiny decoder and a training loop over a data-parallel x context-parallel mesh.

Main entries: :func:`examples.training.train` (the loop, one process or a ``("dp", "cp")`` mesh),
:func:`examples.training.run_distributed` (the same on every rank of a launched group), ``python -m examples``
(the loop from the command line, also under torchrun), ``python -m examples.demo`` (CP 1 vs CP n parity,
``make train-demo``), :mod:`examples.hf` (tiny transformers Llama / Qwen2 models).
"""

from .model import TinyConfig, TinyDecoder
from .training import TrainConfig, TrainResult, parity, run_distributed, train

__all__ = ["TinyConfig", "TinyDecoder", "TrainConfig", "TrainResult", "parity", "run_distributed", "train"]
