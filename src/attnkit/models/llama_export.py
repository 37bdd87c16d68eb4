"""A :class:`~attnkit.models.gpt.GPT` as a Hugging Face Llama checkpoint, both ways.

``save_llama(model, directory, tokenizer)`` writes ``config.json`` (``LlamaForCausalLM``),
``model.safetensors`` and ``tokenizer.json`` (+ ``tokenizer_config.json``), which
``transformers.LlamaForCausalLM.from_pretrained(directory)`` runs with the same logits (tested);
``load_llama(directory)`` reads such a directory back into a GPT. Needs ``safetensors`` (and
``tokenizers`` for the tokenizer), never ``transformers``.

The directory is untrusted input: :func:`attnkit.models.llama_export.gpt_config_from_hf` checks
every key it reads (type and range, the head counts against the hidden size, the rotary settings),
and :func:`attnkit.models.llama_export.load_llama` checks every tensor against the config
(present, no extra, shape, floating dtype, finite) and the tokenizer's ids against ``vocab_size`` before a model is built; each failure is a
``ValueError`` naming the file and the key or tensor. ``save_llama`` stores a SHA-256 of the
tensors in the safetensors metadata, so damage to the weights' bytes of a directory it wrote
is refused too (see :mod:`attnkit.models.checkpoint`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .._json import loads_untrusted
from .._optional import require
from .checkpoint import CHECKSUM_KEY, check_layer_count, check_vocabulary, check_weights, read_json, \
    read_safetensors, read_tokenizer_file, tensor_checksum, verify_checksum
from .bert import MAX_SIZE
from ._meta import meta_state_dict
from .gpt import GPT, GPTConfig

# Keys of config.json that map one to one onto GPTConfig.
_SHARED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                "attention_dropout", "bos_token_id", "eos_token_id")


def hf_config(config: GPTConfig) -> dict:
    """The ``config.json`` of ``LlamaForCausalLM`` for ``config``. Both spellings of the rotary
    base are written: ``rope_parameters`` (transformers 5) and ``rope_theta`` (transformers 4).

    Args:
        config: a :class:`attnkit.models.gpt.GPTConfig`.

    Returns:
        The JSON-serialisable ``dict``.

    Raises:
        ValueError: ``config.attention_only`` (no Llama equivalent).

    Example:

    >>> from attnkit.models.gpt import GPTConfig
    >>> from attnkit.models.llama_export import hf_config
    >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
    >>> raw = hf_config(config)
    >>> raw["architectures"], raw["head_dim"], raw["rope_parameters"]
    (['LlamaForCausalLM'], 8, {'rope_type': 'default', 'rope_theta': 10000.0})
    >>> hf_config(GPTConfig(attention_only=True))
    Traceback (most recent call last):
    ...
    ValueError: an attention-only GPT (no feed-forward) has no Llama equivalent; it cannot be exported
    """
    if config.attention_only:
        raise ValueError("an attention-only GPT (no feed-forward) has no Llama equivalent; it cannot be exported")
    raw = {key: getattr(config, key) for key in _SHARED_KEYS}
    raw.update(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", head_dim=config.head_dim,
        attention_bias=False, mlp_bias=False, pretraining_tp=1, torch_dtype="float32", use_cache=True,
        rope_theta=float(config.rope_theta),
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
    )
    return raw


def hf_name(name: str) -> str:
    """Our parameter name -> ``LlamaForCausalLM``'s (inverse of
    :func:`attnkit.models.llama_export.attnkit_name`).

    Example:

    >>> from attnkit.models.llama_export import hf_name
    >>> hf_name("layers.0.self_attn.out_proj.weight")
    'model.layers.0.self_attn.o_proj.weight'
    >>> hf_name("lm_head.weight")
    'lm_head.weight'
    """
    if name.startswith("lm_head."):
        return name
    return "model." + name.replace(".self_attn.out_proj.", ".self_attn.o_proj.")


def attnkit_name(name: str) -> str:
    """``LlamaForCausalLM``'s parameter name -> ours (inverse of
    :func:`attnkit.models.llama_export.hf_name`).

    Raises:
        ValueError: ``name`` is neither ``lm_head.*`` nor ``model.*``.

    Example:

    >>> from attnkit.models.llama_export import attnkit_name
    >>> attnkit_name("model.layers.0.self_attn.o_proj.weight")
    'layers.0.self_attn.out_proj.weight'
    >>> attnkit_name("transformer.wte.weight")
    Traceback (most recent call last):
    ...
    ValueError: unexpected parameter 'transformer.wte.weight' in model.safetensors (not a LlamaForCausalLM weight)
    """
    if name.startswith("lm_head."):
        return name
    if not name.startswith("model."):
        raise ValueError(f"unexpected parameter {name!r} in model.safetensors (not a LlamaForCausalLM weight)")
    return name[len("model."):].replace(".self_attn.o_proj.", ".self_attn.out_proj.")


def save_llama(model: GPT, directory: str | Path, tokenizer=None) -> Path:
    """Write ``model`` (and a ``tokenizers.Tokenizer``) as a Hugging Face Llama directory.

    Writes ``config.json`` (:func:`attnkit.models.llama_export.hf_config`), ``model.safetensors``
    (with a SHA-256 of the tensors in its metadata) and, with a tokenizer, ``tokenizer.json`` and
    ``tokenizer_config.json``. The directory is created if needed; files in it are overwritten.

    Args:
        model: a :class:`attnkit.models.gpt.GPT` (not attention-only).
        directory: where to write.
        tokenizer: a ``tokenizers.Tokenizer``, or None to write no tokenizer.

    Returns:
        ``directory`` as a ``pathlib.Path``.

    Raises:
        ValueError: the model is attention-only.
        ImportError: ``safetensors`` is not installed.

    Example:

    >>> from attnkit.models.gpt import GPT, GPTConfig
    >>> from attnkit.models.llama_export import save_llama
    >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
    >>> directory = save_llama(GPT(config), "tiny-llama")
    >>> sorted(path.name for path in directory.iterdir())
    ['config.json', 'model.safetensors']
    """
    safetensors_torch = require("safetensors.torch", "saving model.safetensors", extra="models")
    directory = Path(directory)
    raw = hf_config(model.config)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    weights = {hf_name(name): tensor.detach().contiguous()
               for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight")  # one tensor stored once, as transformers does
    safetensors_torch.save_file(weights, str(directory / "model.safetensors"),
                                metadata={"format": "pt", CHECKSUM_KEY: tensor_checksum(weights)})
    if tokenizer is not None:
        tokenizer.save(str(directory / "tokenizer.json"))
        special = {}
        for key, token_id in (("bos_token", model.config.bos_token_id), ("eos_token", model.config.eos_token_id)):
            if token_id is not None:
                special[key] = tokenizer.id_to_token(token_id)
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.config.max_position_embeddings,
                    "clean_up_tokenization_spaces": False, **special}
        (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    return directory


# The integer sizes of config.json, all required: the smallest value each may take.
_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "intermediate_size", "max_position_embeddings")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def gpt_config_from_hf(raw: dict, *, source: str = "config.json") -> GPTConfig:
    """Check a Llama ``config.json`` for what :class:`attnkit.models.gpt.GPT` implements and convert
    it. Every key read is checked for type and range; an error names ``source`` and the key.

    Args:
        raw: the parsed ``config.json``.
        source: what the errors call it, usually the file's path.

    Returns:
        The :class:`attnkit.models.gpt.GPTConfig`.

    Raises:
        ValueError: ``raw`` is not a ``"llama"`` config attnkit implements (rotary scaling, an
            activation other than SiLU, biases, a separate ``head_dim``), lacks a required key,
            or holds a value of the wrong type or range.

    Example:

    >>> from attnkit.models.gpt import GPTConfig
    >>> from attnkit.models.llama_export import gpt_config_from_hf, hf_config
    >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
    >>> raw = hf_config(config)
    >>> gpt_config_from_hf(raw) == config
    True
    >>> gpt_config_from_hf({**raw, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    Traceback (most recent call last):
    ...
    ValueError: config.json: rope_scaling.rope_type 'linear' is not implemented; attnkit's GPT implements the 'default' rotary embedding (no scaling)
    """
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object of settings, got {type(raw).__name__}")
    if raw.get("model_type") != "llama":
        raise ValueError(f"{source}: model_type is {raw.get('model_type')!r}; attnkit's GPT loads 'llama' checkpoints")
    # transformers 5 writes rope_parameters, 4 wrote rope_scaling (its type as "rope_type", earlier "type"):
    # the error names the key that holds the scaling, not the other one's "default".
    for key in ("rope_parameters", "rope_scaling"):
        parameters = raw.get(key)
        if parameters is None:
            continue
        if not isinstance(parameters, dict):
            raise ValueError(f"{source}: {key} must be a mapping, got {parameters!r}")
        field = "rope_type" if "rope_type" in parameters else "type"
        kind = parameters.get(field, "default")
        if kind != "default":
            raise ValueError(f"{source}: {key}.{field} {kind!r} is not implemented; attnkit's GPT implements "
                             f"the 'default' rotary embedding (no scaling)")
    for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if key in raw and (raw[key] != expected or type(raw[key]) is not type(expected)):
            raise ValueError(f"{source}: {key} is {raw[key]!r}; attnkit's GPT implements {expected!r}")
    missing = [key for key in (*_SIZES, "rms_norm_eps") if key not in raw]
    if missing:
        # rms_norm_eps is required: its default differs between attnkit (1e-5) and transformers (1e-6)
        raise ValueError(f"{source}: missing required key(s) {missing}")
    for key in _SIZES:
        # bounded above too: torch cannot even describe a tensor with a dimension of 2**63
        if not _is_int(raw[key]) or not 1 <= raw[key] <= MAX_SIZE:
            raise ValueError(f"{source}: {key} must be an integer in [1, {MAX_SIZE}], got {raw[key]!r}")
    values: dict = {key: raw[key] for key in _SIZES}
    if not _is_number(raw["rms_norm_eps"]) or raw["rms_norm_eps"] <= 0:
        raise ValueError(f"{source}: rms_norm_eps must be a finite number > 0, got {raw['rms_norm_eps']!r}")
    values["rms_norm_eps"] = float(raw["rms_norm_eps"])
    tie = raw.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ValueError(f"{source}: tie_word_embeddings must be true or false, got {tie!r}")
    values["tie_word_embeddings"] = tie
    dropout = raw.get("attention_dropout", 0.0)
    if not _is_number(dropout) or not 0 <= dropout < 1:
        raise ValueError(f"{source}: attention_dropout must be a probability in [0, 1), got {dropout!r}")
    values["attention_dropout"] = float(dropout)
    for key in ("bos_token_id", "eos_token_id"):
        value = raw.get(key)
        ids = value if isinstance(value, list) and key == "eos_token_id" else [value]
        for token_id in ids:
            if token_id is not None and (not _is_int(token_id) or not 0 <= token_id < raw["vocab_size"]):
                raise ValueError(f"{source}: {key} must be a token id in [0, {raw['vocab_size']}) or null, "
                                 f"got {value!r}")
        values[key] = ids[0] if ids else None
    values["rope_theta"] = _rope_theta(raw, source)
    for a, b in (("hidden_size", "num_attention_heads"), ("num_attention_heads", "num_key_value_heads")):
        if raw[a] % raw[b]:
            raise ValueError(f"{source}: {a} {raw[a]} is not divisible by {b} {raw[b]}")
    head_dim = raw["hidden_size"] // raw["num_attention_heads"]
    if raw.get("head_dim") is not None and (not _is_int(raw["head_dim"]) or raw["head_dim"] != head_dim):
        raise ValueError(f"{source}: head_dim {raw['head_dim']!r} differs from hidden_size / num_attention_heads "
                         f"({head_dim}); attnkit's GPT implements only that")
    if head_dim % 2:
        raise ValueError(f"{source}: hidden_size / num_attention_heads is {head_dim}; rotary embeddings need "
                         f"an even head size")
    try:
        return GPTConfig(**values)
    except ValueError as error:  # a rule of GPTConfig's own that the checks above missed
        raise ValueError(f"{source}: {error}") from error


def _rope_theta(raw: dict, source: str) -> float:
    """The rotary base from ``rope_parameters.rope_theta`` or ``rope_theta`` (10000 when neither is
    given); both given and different is refused, as transformers 4 and 5 would then disagree."""
    found = {}
    parameters = raw.get("rope_parameters")
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        found["rope_parameters.rope_theta"] = parameters["rope_theta"]
    if "rope_theta" in raw:
        found["rope_theta"] = raw["rope_theta"]
    for key, value in found.items():
        if not _is_number(value) or value <= 0:
            raise ValueError(f"{source}: {key} must be a finite number > 0, got {value!r}")
    if len({float(v) for v in found.values()}) > 1:
        raise ValueError(f"{source}: rope_parameters.rope_theta {found['rope_parameters.rope_theta']!r} and "
                         f"rope_theta {found['rope_theta']!r} disagree")
    return float(next(iter(found.values()), 10000.0))


def written_by_save_llama(directory: str | Path) -> bool:
    """Whether ``directory`` holds a GPT that :func:`attnkit.models.llama_export.save_llama` wrote
    (``attnkit train`` does): its ``config.json`` is exactly the one
    :func:`attnkit.models.llama_export.hf_config` writes for the config it describes, and the
    weights and tokenizer are there. A checkpoint transformers saved carries keys of its own
    (``transformers_version``, ``dtype``, ...), so it is never mistaken for one.

    Returns:
        A ``bool``; never raises for a missing or damaged directory (it is then False).

    Example:

    >>> import json
    >>> from pathlib import Path
    >>> from attnkit.models.gpt import GPT, GPTConfig
    >>> from attnkit.models.llama_export import save_llama, written_by_save_llama
    >>> from attnkit.training.corpus import train_tokenizer
    >>> tokenizer = train_tokenizer(["the cat sat on the mat"], vocab_size=280)
    >>> model = GPT(GPTConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=1,
    ...                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=64))
    >>> directory = save_llama(model, "tiny-llama", tokenizer)
    >>> written_by_save_llama(directory)
    True
    >>> raw = json.loads((directory / "config.json").read_text())
    >>> _ = (directory / "config.json").write_text(json.dumps({**raw, "transformers_version": "4.57.0"}))
    >>> written_by_save_llama(directory), written_by_save_llama("no/such/directory")
    (False, False)
    """
    directory = Path(directory)
    if not all((directory / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json")):
        return False
    try:
        raw = loads_untrusted((directory / "config.json").read_text(encoding="utf-8"))
        return raw == json.loads(json.dumps(hf_config(gpt_config_from_hf(raw))))
    except (ValueError, TypeError, AttributeError, OSError):  # UnicodeDecodeError is a ValueError
        return False


def load_llama(directory: str | Path) -> tuple[GPT, object | None]:
    """Read a Llama directory into ``(GPT in eval mode, tokenizers.Tokenizer or None)``. Every file is
    checked first (see :mod:`attnkit.models.llama_export`); a damaged one is a ValueError naming it.

    Args:
        directory: holds ``config.json`` and ``model.safetensors`` (``LlamaForCausalLM``), and
            optionally ``tokenizer.json``.

    Returns:
        ``(model, tokenizer)``: a float32 :class:`attnkit.models.gpt.GPT`, and the tokenizer or
        None when the directory has no ``tokenizer.json``.

    Raises:
        FileNotFoundError: the directory, its ``config.json`` or its ``model.safetensors`` is missing.
        ValueError: a file is damaged or does not fit the config (the message names it).

    Example:

    >>> import torch
    >>> from attnkit.models.gpt import GPT, GPTConfig
    >>> from attnkit.models.llama_export import load_llama, save_llama
    >>> config = GPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32)
    >>> model = GPT(config).eval()
    >>> loaded, tokenizer = load_llama(save_llama(model, "tiny-llama"))
    >>> tokens = torch.tensor([[1, 2, 3]])
    >>> torch.equal(loaded(tokens), model(tokens)), loaded.training, tokenizer
    (True, False, None)
    >>> load_llama("no/such/directory")
    Traceback (most recent call last):
    ...
    FileNotFoundError: model directory 'no/such/directory' does not exist
    """
    directory = Path(directory)
    if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
        problem = "does not exist" if not directory.exists() else "has no config.json and model.safetensors"
        raise FileNotFoundError(f"model directory {str(directory)!r} {problem}")
    config_path, weights_path = directory / "config.json", directory / "model.safetensors"
    config = gpt_config_from_hf(read_json(config_path), source=str(config_path))
    weights = {}
    stored, metadata = read_safetensors(weights_path)
    for name, tensor in stored.items():
        try:
            weights[attnkit_name(name)] = tensor
        except ValueError as error:
            raise ValueError(f"{weights_path}: {error}") from error
    if config.tie_word_embeddings and "lm_head.weight" in weights:
        # tied: one matrix; a second, different one would silently replace the embeddings on load
        embeddings = weights.get("embed_tokens.weight")
        if embeddings is None or not torch.equal(weights["lm_head.weight"], embeddings):
            raise ValueError(f"{weights_path}: unexpected lm_head.weight: {config_path} has tie_word_embeddings "
                             f"true, so the output layer is embed_tokens.weight")
    if config.tie_word_embeddings and "embed_tokens.weight" in weights:
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    check_layer_count(weights_path, weights, config_path, config.num_hidden_layers)
    expected = meta_state_dict(lambda: GPT(config))  # shapes only: a damaged config must not allocate it
    check_weights(weights_path, weights, expected, names={name: hf_name(name) for name in {*weights, *expected}},
                  config_path=config_path)
    verify_checksum(weights_path, stored, metadata)
    model = GPT(config)
    with torch.no_grad():
        model.load_state_dict({k: v.float() for k, v in weights.items()})
    tokenizer = None
    if (directory / "tokenizer.json").exists():
        tokenizer = read_tokenizer_file(directory / "tokenizer.json")
        check_vocabulary(tokenizer, config, directory)
    return model.eval(), tokenizer
