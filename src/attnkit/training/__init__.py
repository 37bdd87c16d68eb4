"""Training a GPT on attnkit: the corpus and tokenizer, packed rows, the loop, checkpoints.

    from attnkit.training import TrainConfig, train
    result = train(TrainConfig(out="out/gpt", steps=500))     # also: attnkit train --out out/gpt
    result.sample, result.evals                               # text, [(step, validation loss)]

Imports ``tokenizers`` and ``safetensors`` (``pip install 'attnkit[models]'``) when it runs.
"""

from .packing import Rows, batch_order, pack_documents, pad_documents
from .trainer import TrainConfig, TrainResult, evaluate, learning_rate, train

__all__ = ["TrainConfig", "TrainResult", "train", "evaluate", "learning_rate", "Rows", "pack_documents",
           "pad_documents", "batch_order"]
