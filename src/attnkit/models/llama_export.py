"""A :class:`~attnkit.models.gpt.GPT` as a Hugging Face Llama checkpoint, both ways.

``save_llama(model, directory, tokenizer)`` writes ``config.json`` (``LlamaForCausalLM``),
``model.safetensors`` and ``tokenizer.json`` (+ ``tokenizer_config.json``), which
``transformers.LlamaForCausalLM.from_pretrained(directory)`` runs with the same logits (tested);
``load_llama(directory)`` reads such a directory back into a GPT. Needs ``safetensors`` (and
``tokenizers`` for the tokenizer), never ``transformers``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .._optional import require
from .gpt import GPT, GPTConfig

# Keys of config.json that map one to one onto GPTConfig.
_SHARED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                "attention_dropout", "bos_token_id", "eos_token_id")


def hf_config(config: GPTConfig) -> dict:
    """The ``config.json`` of ``LlamaForCausalLM`` for ``config``. Both spellings of the rotary
    base are written: ``rope_parameters`` (transformers 5) and ``rope_theta`` (transformers 4)."""
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
    """Our parameter name -> ``LlamaForCausalLM``'s."""
    if name.startswith("lm_head."):
        return name
    return "model." + name.replace(".self_attn.out_proj.", ".self_attn.o_proj.")


def attnkit_name(name: str) -> str:
    """``LlamaForCausalLM``'s parameter name -> ours."""
    if name.startswith("lm_head."):
        return name
    if not name.startswith("model."):
        raise ValueError(f"unexpected parameter {name!r} in model.safetensors (not a LlamaForCausalLM weight)")
    return name[len("model."):].replace(".self_attn.o_proj.", ".self_attn.out_proj.")


def save_llama(model: GPT, directory: str | Path, tokenizer=None) -> Path:
    """Write ``model`` (and a ``tokenizers.Tokenizer``) as a Hugging Face Llama directory."""
    safetensors_torch = require("safetensors.torch", "saving model.safetensors", extra="models")
    directory = Path(directory)
    raw = hf_config(model.config)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    weights = {hf_name(name): tensor.detach().contiguous()
               for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight")  # one tensor stored once, as transformers does
    safetensors_torch.save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
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


def gpt_config_from_hf(raw: dict, *, source: str = "config.json") -> GPTConfig:
    """Check a Llama ``config.json`` for what :class:`GPT` implements and convert it."""
    if raw.get("model_type") != "llama":
        raise ValueError(f"{source}: model_type is {raw.get('model_type')!r}; attnkit's GPT loads 'llama' checkpoints")
    rope = raw.get("rope_parameters") or {}
    # transformers 5 writes rope_parameters, 4 wrote rope_scaling (its type as "rope_type", earlier "type"):
    # the error names the key that holds the scaling, not the other one's "default".
    for key, parameters in (("rope_parameters", rope), ("rope_scaling", raw.get("rope_scaling") or {})):
        if not isinstance(parameters, dict):
            raise ValueError(f"{source}: {key} must be a mapping, got {parameters!r}")
        field = "rope_type" if "rope_type" in parameters else "type"
        kind = parameters.get(field, "default")
        if kind != "default":
            raise ValueError(f"{source}: {key}.{field} {kind!r} is not implemented; attnkit's GPT implements "
                             f"the 'default' rotary embedding (no scaling)")
    for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if raw.get(key, expected) != expected:
            raise ValueError(f"{source}: {key} is {raw[key]!r}; attnkit's GPT implements {expected!r}")
    missing = [key for key in _SHARED_KEYS[:7] if key not in raw]
    if missing:
        raise ValueError(f"{source}: missing required key(s) {missing}")
    values = {key: raw[key] for key in _SHARED_KEYS if key in raw}
    if isinstance(values.get("eos_token_id"), list):
        values["eos_token_id"] = values["eos_token_id"][0]
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    config = GPTConfig(**values, rope_theta=float(theta))
    if raw.get("head_dim", config.head_dim) != config.head_dim:
        raise ValueError(f"{source}: head_dim {raw['head_dim']} differs from hidden_size / num_attention_heads")
    return config


def written_by_save_llama(directory: str | Path) -> bool:
    """Whether ``directory`` holds a GPT that :func:`save_llama` wrote (``attnkit train`` does): its
    ``config.json`` is exactly the one :func:`hf_config` writes for the config it describes, and the
    weights and tokenizer are there. A checkpoint transformers saved carries keys of its own
    (``transformers_version``, ``dtype``, ...), so it is never mistaken for one."""
    directory = Path(directory)
    if not all((directory / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json")):
        return False
    try:
        raw = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        return raw == json.loads(json.dumps(hf_config(gpt_config_from_hf(raw))))
    except (ValueError, TypeError, AttributeError, OSError, UnicodeDecodeError):
        return False


def load_llama(directory: str | Path) -> tuple[GPT, object | None]:
    """Read a Llama directory into ``(GPT in eval mode, tokenizers.Tokenizer or None)``."""
    directory = Path(directory)
    if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
        problem = "does not exist" if not directory.exists() else "has no config.json and model.safetensors"
        raise FileNotFoundError(f"model directory {str(directory)!r} {problem}")
    safetensors_torch = require("safetensors.torch", "loading model.safetensors", extra="models")
    try:
        raw = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{directory / 'config.json'}: not valid JSON ({error})") from None
    config = gpt_config_from_hf(raw, source=str(directory / "config.json"))
    model = GPT(config)
    weights = {attnkit_name(name): tensor for name, tensor in
               safetensors_torch.load_file(str(directory / "model.safetensors")).items()}
    if config.tie_word_embeddings:
        weights.setdefault("lm_head.weight", weights.get("embed_tokens.weight"))
    expected = set(model.state_dict())
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise ValueError(f"{directory / 'model.safetensors'}: missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        model.load_state_dict({k: v.float() for k, v in weights.items()})
    tokenizer = None
    if (directory / "tokenizer.json").is_file():
        tokenizers = require("tokenizers", "reading tokenizer.json", extra="models")
        tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    return model.eval(), tokenizer

