"""Training checkpoints that resume bit for bit: model, AdamW state, dropout generator, step.

A checkpoint directory holds ``state.safetensors`` (every tensor: ``model.<name>``,
``optimizer.<index>.<key>`` and ``generator``, the dropout generator's state as bytes),
``state.json`` (the step, the configs, the optimizer's hyper-parameters, the losses so far) and
``tokenizer.json``. The data position is the step itself: which rows a step reads is a pure
function of ``(step, seed)`` (:func:`attnkit.training.packing.batch_order`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .._optional import require


def save_checkpoint(directory: Path, *, model, optimizer, generator: torch.Generator, state: dict, tokenizer) -> Path:
    """Write the checkpoint into a temporary sibling, then swap it in: a run killed while
    saving leaves the previous checkpoint whole."""
    safetensors_torch = require("safetensors.torch", "saving checkpoints", extra="models")
    directory = Path(directory)
    staging = directory.with_name(directory.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tensors = {f"model.{name}": tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("model.lm_head.weight")
    optimizer_state = optimizer.state_dict()
    for index, values in optimizer_state["state"].items():
        for key, tensor in values.items():
            tensors[f"optimizer.{index}.{key}"] = tensor.detach().contiguous()
    tensors["generator"] = generator.get_state()
    safetensors_torch.save_file(tensors, str(staging / "state.safetensors"))
    record = {**state, "param_groups": optimizer_state["param_groups"]}
    (staging / "state.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    tokenizer.save(str(staging / "tokenizer.json"))
    if directory.exists():
        old = directory.with_name(directory.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
        os.replace(staging, directory)
        shutil.rmtree(old)
    else:
        os.replace(staging, directory)
    return directory


def read_state(directory: Path) -> dict:
    """``state.json`` of a checkpoint, or a clear error when there is none."""
    path = Path(directory) / "state.json"
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint to resume from: {str(path)!r} does not exist")
    return json.loads(path.read_text(encoding="utf-8"))


def load_checkpoint(directory: Path, *, model, optimizer, generator: torch.Generator) -> dict:
    """Restore ``model``, ``optimizer`` and ``generator`` in place; returns ``state.json``."""
    safetensors_torch = require("safetensors.torch", "loading checkpoints", extra="models")
    record = read_state(directory)
    tensors = safetensors_torch.load_file(str(Path(directory) / "state.safetensors"))
    weights = {name[len("model."):]: t for name, t in tensors.items() if name.startswith("model.")}
    if model.config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    model.load_state_dict(weights)
    state: dict[int, dict] = {}
    for name, tensor in tensors.items():
        if name.startswith("optimizer."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = tensor
    optimizer.load_state_dict({"state": state, "param_groups": record["param_groups"]})
    generator.set_state(tensors["generator"])
    return record


def read_tokenizer(directory: Path):
    """The checkpoint's ``tokenizers.Tokenizer``."""
    tokenizers = require("tokenizers", "resuming training", extra="models")
    return tokenizers.Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
