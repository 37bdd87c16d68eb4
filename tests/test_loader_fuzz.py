"""Damaged model directories (issue 25, points 2 and 6): files are untrusted input.

A tiny valid directory of each format attnkit loads itself -- attnkit's GPT written by
``save_llama`` (untied and tied embeddings) and a BERT encoder -- is damaged one way at a time,
by a seeded RNG: each file truncated, garbled, emptied, deleted; each config key deleted, set
to another type, out of range or nested deep; tensors removed, added, reshaped, retyped. The
loader must then either raise a ValueError naming the damaged file (and the key or tensor where
one was damaged), or load a model that computes what the files say: the original's outputs, or,
where a config value changed to another valid one, exactly the original weights under the
config the file states. Any other exception, or a different computation, fails.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")
tokenizers = pytest.importorskip("tokenizers")

from attnkit import models  # noqa: E402
from attnkit.models.bert import BertConfig, BertEncoder  # noqa: E402
from attnkit.models.gpt import GPT, GPTConfig  # noqa: E402
from attnkit.models.llama_export import load_llama, save_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = [f"w{i}" for i in range(38)]
VOCAB = 48
INPUT = torch.tensor([[2, 5, 7, 11, 13, 1, 40, 3]])
SEED = 25
CASES_PER_DIRECTORY = 140


def _tokenizer():
    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return tokenizer


def _gpt_directory(path: Path, tie: bool) -> tuple[Path, GPTConfig, dict]:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32, rope_theta=500.0,
                       tie_word_embeddings=tie, eos_token_id=1)
    model = GPT(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    save_llama(model, path, tokenizer=_tokenizer())
    return path, config, {k: v.clone() for k, v in model.state_dict().items()}


# attnkit's BERT names -> Hugging Face's (the inverse of checkpoint._RENAMES)
_TO_HF = [(r"embeddings\.word\.", "embeddings.word_embeddings."), (r"embeddings\.position\.", "embeddings.position_embeddings."),
          (r"embeddings\.token_type\.", "embeddings.token_type_embeddings."), (r"embeddings\.norm\.", "embeddings.LayerNorm."),
          (r"layers\.(\d+)\.attention\.q_proj\.", r"encoder.layer.\1.attention.self.query."),
          (r"layers\.(\d+)\.attention\.k_proj\.", r"encoder.layer.\1.attention.self.key."),
          (r"layers\.(\d+)\.attention\.v_proj\.", r"encoder.layer.\1.attention.self.value."),
          (r"layers\.(\d+)\.attention\.out_proj\.", r"encoder.layer.\1.attention.output.dense."),
          (r"layers\.(\d+)\.attention_norm\.", r"encoder.layer.\1.attention.output.LayerNorm."),
          (r"layers\.(\d+)\.intermediate\.", r"encoder.layer.\1.intermediate.dense."),
          (r"layers\.(\d+)\.output\.", r"encoder.layer.\1.output.dense."),
          (r"layers\.(\d+)\.output_norm\.", r"encoder.layer.\1.output.LayerNorm.")]


def _hf_bert_name(name: str) -> str:
    for pattern, replacement in _TO_HF:
        renamed, count = re.subn("^" + pattern, replacement, name)
        if count:
            return renamed
    raise AssertionError(name)


def _bert_directory(path: Path) -> tuple[Path, BertConfig, dict]:
    torch.manual_seed(1)
    raw = dict(model_type="bert", architectures=["BertModel"], vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=48, max_position_embeddings=32, type_vocab_size=2,
               layer_norm_eps=1e-12, hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
               pad_token_id=1, position_embedding_type="absolute")
    config = BertConfig.from_dict(raw)
    model = BertEncoder(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    weights = {_hf_bert_name(k): v.contiguous() for k, v in model.state_dict().items()}
    safetensors_torch.save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    _tokenizer().save(str(path / "tokenizer.json"))
    return path, config, {k: v.clone() for k, v in model.state_dict().items()}


# --- the formats under test: how to load one, run it, and rebuild a reference ------------------------------

def _run_gpt(model) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT)


def _run_bert(model) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT)[0]


def _load_gpt(directory: Path):
    model, tokenizer = load_llama(directory)
    return model, model.config


def _load_bert(directory: Path):
    encoder = models.load(directory)
    return encoder.model, encoder.model.config


def _reference(kind: str, config, weights: dict) -> torch.Tensor:
    """The original weights under ``config`` (what the files say, when only a value changed)."""
    model = (GPT(config) if kind == "gpt" else BertEncoder(config)).eval()
    model.load_state_dict(weights)
    return _run_gpt(model) if kind == "gpt" else _run_bert(model)


# --- damage ---------------------------------------------------------------------------------------------------

def _other_values(rng: random.Random, value):
    """Values of another type, or the same type out of range."""
    choices = [None, "32", [value], {"value": value}, True, False, 0, -1, -0.5, 1.5, 10**9, 10**30, "nan",
               float("nan"), float("inf"), float("-inf"), 3, 64, 1e-3, 2.5, "default", "linear", []]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        choices += [value + 1, value * 2, value - 1, float(value), str(value)]
    return rng.choice(choices)


def _header_end(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little") if len(data) >= 8 else len(data)


def _damages(rng: random.Random, directory: Path, kind: str):
    """Yield (description, file name, key or tensor named or None, function(dir) applying it)."""
    config = json.loads((directory / "config.json").read_text())
    tensors = safetensors_torch.load_file(str(directory / "model.safetensors"))
    with open(directory / "model.safetensors", "rb") as handle:
        header_end = _header_end(handle.read(8) + b"\0" * 8)
    files = ["config.json", "model.safetensors", "tokenizer.json"]
    while True:
        choice = rng.random()
        if choice < 0.3:  # a whole file
            name = rng.choice(files)
            how = rng.choice(["truncate", "garble", "empty", "delete", "append"])
            size = (directory / name).stat().st_size
            # a HF file has no checksum: a flipped byte inside a weight is a different weight, not
            # damage anyone can see; its header (names, shapes, offsets) is garbled instead
            limit = header_end if (name == "model.safetensors" and kind == "bert") else size
            spots = sorted(rng.randrange(limit) for _ in range(rng.randint(1, 4)))
            cut = rng.randrange(size)

            def apply(d, name=name, how=how, spots=spots, cut=cut):
                path = d / name
                data = bytearray(path.read_bytes())
                if how == "truncate":
                    data = data[:cut]
                elif how == "garble":
                    for spot in spots:
                        data[spot] = (data[spot] + rng_bytes.randrange(1, 256)) % 256
                elif how == "empty":
                    data = bytearray()
                elif how == "append":
                    data += b"\x00garbage"
                if how == "delete":
                    path.unlink()
                else:
                    path.write_bytes(bytes(data))
            yield f"{how} {name} {spots if how == 'garble' else cut}", name, None, apply
        elif choice < 0.65:  # one key of config.json
            key = rng.choice(sorted(config))
            how = rng.choice(["delete", "value", "value", "deep"])
            value = _other_values(rng, config[key])

            def apply(d, key=key, how=how, value=value):
                raw = json.loads((d / "config.json").read_text())
                if how == "delete":
                    del raw[key]
                    text = json.dumps(raw)
                elif how == "value":
                    raw[key] = value
                    text = json.dumps(raw)
                else:  # deeper than json's recursion limit
                    raw[key] = "@DEEP@"
                    text = json.dumps(raw).replace('"@DEEP@"', "[" * 100_000 + "]" * 100_000)
                (d / "config.json").write_text(text)
            yield f"config {how} {key}={value!r}", "config.json", key, apply
        else:  # one tensor of model.safetensors
            name = rng.choice(sorted(tensors))
            how = rng.choice(["remove", "add", "reshape", "transpose", "rows", "int", "half", "nan"])
            keep_checksum = rng.random() < 0.5
            added = name.replace("layers.0.", "layers.0.extra_").replace("layer.0.", "layer.0.extra_") + ".extra"

            def apply(d, name=name, how=how, keep_checksum=keep_checksum, added=added):
                from safetensors import safe_open

                with safe_open(str(d / "model.safetensors"), framework="pt") as handle:
                    metadata = handle.metadata()
                stored = safetensors_torch.load_file(str(d / "model.safetensors"))
                tensor = stored[name]
                if how == "remove":
                    del stored[name]
                elif how == "add":
                    stored[added] = torch.zeros(3)
                elif how == "reshape":
                    stored[name] = tensor.reshape(-1)
                elif how == "transpose":
                    stored[name] = tensor.t().contiguous() if tensor.dim() == 2 else tensor[None]
                elif how == "rows":
                    stored[name] = tensor[:-1].contiguous()
                elif how == "int":
                    stored[name] = tensor.to(torch.int32)
                elif how == "half":
                    stored[name] = tensor.half()
                else:
                    stored[name] = tensor.clone().index_fill_(0, torch.tensor([0]), float("nan"))
                if not keep_checksum:
                    metadata = {"format": "pt"}
                safetensors_torch.save_file(stored, str(d / "model.safetensors"), metadata=metadata)
            yield (f"tensor {how} {name} (checksum kept: {keep_checksum})", "model.safetensors",
                   added if how == "add" else name, apply)


rng_bytes = random.Random(SEED + 1)

# Damages that keep a tensor's name, shape and a float dtype but change what it holds: with no checksum
# in the file (the case of every file transformers writes) nothing can tell them from a weight, so a
# model that loads must compute with the tensor as stored (with one, loading fails the test). A
# transposed square matrix (q_proj, o_proj and BERT's attention weights are hidden x hidden) is one;
# other matrices change shape and are refused.
_STORED_AS = {"half": lambda t: t.half().float(), "transpose": lambda t: t.t()}


def _carries_checksum(directory: Path) -> bool:
    """Whether the directory's model.safetensors holds the checksum save_llama writes."""
    from safetensors import safe_open

    from attnkit.models.checkpoint import CHECKSUM_KEY

    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        return CHECKSUM_KEY in (handle.metadata() or {})


def _reads_as(stated, loaded) -> bool:
    """Whether a config value as the file states it is the value loaded: equal, or a JSON integer read
    into a float field (``10**30`` is loaded as ``1e30``, the nearest float, which Python's ``==``
    tells apart from the integer)."""
    if isinstance(stated, int) and not isinstance(stated, bool) and isinstance(loaded, float):
        try:
            return float(stated) == loaded
        except OverflowError:
            return False
    return stated == loaded


def _stated_differences(kind: str, original, loaded, raw_after: dict | None) -> list[str]:
    """Fields where ``loaded`` differs from ``original`` that config.json does not state (a silent change)."""
    silent = []
    for field in dataclasses.fields(original):
        before, after = getattr(original, field.name), getattr(loaded, field.name)
        if before == after or (isinstance(before, float) and before != before and after != after):
            continue
        stated = raw_after is not None and (
            _reads_as(raw_after.get(field.name, field.default), after)
            or (field.name == "rope_theta" and isinstance(raw_after.get("rope_parameters"), dict)
                and raw_after["rope_parameters"].get("rope_theta") == after)
            or (field.name == "eos_token_id" and isinstance(raw_after.get("eos_token_id"), list)
                and raw_after["eos_token_id"][:1] == ([] if after is None else [after]))  # the first id, or none
            or (field.name == "rope_theta" and "rope_theta" not in raw_after and after == 10000.0
                and "rope_theta" not in (raw_after.get("rope_parameters") or {})))
        if not stated:
            silent.append(f"{field.name}: {before!r} -> {after!r}")
    return silent


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("originals")
    built = {"gpt": _gpt_directory(root / "gpt", tie=False), "gpt-tied": _gpt_directory(root / "gpt-tied", tie=True),
             "bert": _bert_directory(root / "bert")}
    return built


@pytest.mark.parametrize("which", ["gpt", "gpt-tied", "bert"])
def test_a_damaged_directory_is_a_named_valueerror_or_the_same_model(which, originals, tmp_path):
    directory, config, weights = originals[which]
    kind = "bert" if which == "bert" else "gpt"
    load, run = (_load_bert, _run_bert) if kind == "bert" else (_load_gpt, _run_gpt)
    loaded, loaded_config = load(directory)
    assert loaded_config == config
    expected = run(loaded)
    rng = random.Random(f"{SEED}-{which}")
    failures, outcomes = [], {"error": 0, "same": 0, "changed as stated": 0}
    for case, (what, file, named, apply) in enumerate(_damages(rng, directory, kind)):
        if case == CASES_PER_DIRECTORY:
            break
        target = tmp_path / f"case{case}"
        shutil.copytree(directory, target)
        apply(target)
        try:
            model, got_config = load(target)
        except ValueError as error:
            message = str(error)
            if file not in message:
                failures.append(f"{what}: the error does not name {file}: {message}")
            elif named is not None and file != "config.json" and named.removeprefix("model.") not in message \
                    and (_ours(named) or named) not in message:
                failures.append(f"{what}: the error does not name the tensor {named}: {message}")
            elif named is not None and file == "config.json" and named not in message and "deep" not in what and \
                    "model.safetensors" not in message and "tokenizer.json" not in message:
                failures.append(f"{what}: the error does not name the key {named}: {message}")
            outcomes["error"] += 1
            continue
        except FileNotFoundError as error:  # a deleted required file: the documented error for it
            if file not in str(error):
                failures.append(f"{what}: {error!r}")
            outcomes["error"] += 1
            continue
        except BaseException as error:  # noqa: BLE001  anything else is the bug under test
            failures.append(f"{what}: {type(error).__name__}: {str(error)[:200]}")
            continue
        try:
            raw_after = json.loads((target / "config.json").read_text())
        except (ValueError, RecursionError):
            raw_after = None
        silent = _stated_differences(kind, config, got_config, raw_after)
        if silent:
            failures.append(f"{what}: loaded with a config the files do not state: {silent}")
            continue
        got = run(model)
        reference = expected if got_config == config else _reference(kind, got_config, weights)
        as_stored = _STORED_AS.get(what.split()[1]) if what.startswith("tensor ") else None
        if as_stored is not None and not _carries_checksum(target):
            tie = getattr(got_config, "tie_word_embeddings", False)
            stated = {k: (as_stored(v) if hf_equivalent(k, named, tie) else v) for k, v in weights.items()}
            reference = _reference(kind, got_config, stated)
        if not torch.allclose(got, reference, atol=1e-6, rtol=0, equal_nan=False):
            failures.append(f"{what}: loaded, but computes something else "
                            f"(max difference {(got - reference).abs().max().item():.3g})")
            continue
        outcomes["same" if got_config == config else "changed as stated"] += 1
    assert not failures, f"{len(failures)} of {CASES_PER_DIRECTORY} cases:\n" + "\n".join(failures[:40])
    assert outcomes["error"] > CASES_PER_DIRECTORY // 3, outcomes  # the damage did reach the checks


@pytest.mark.parametrize("which", ["gpt", "bert"])
def test_a_huge_layer_count_is_refused_without_allocating_it(which, originals, tmp_path):
    """num_hidden_layers within the config's integer range but far beyond the layers stored (the fuzz
    drew 10**9, and the check of the layers stored took the whole machine's memory to build
    ``set(range(10**9))`` before it could refuse): a ValueError naming both files, its peak Python
    allocation a few MiB where ``set(range(10**7))`` alone takes hundreds."""
    import tracemalloc

    directory, _, _ = originals[which]
    target = tmp_path / which
    shutil.copytree(directory, target)
    raw = json.loads((target / "config.json").read_text())
    raw["num_hidden_layers"] = 10**7
    (target / "config.json").write_text(json.dumps(raw))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"model\.safetensors holds layers 0\.\.1 but .*config\.json has "
                                             r"num_hidden_layers 10000000"):
            (_load_bert if which == "bert" else _load_gpt)(target)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB allocated to refuse a layer count"


DEEP = "[" * 100_000 + "]" * 100_000  # past json's recursion limit: a RecursionError, not a ValueError, from json


def test_a_config_nested_too_deep_is_one_line_from_the_cli(originals, tmp_path, capsys):
    """``attnkit show --model DIR`` asks first whether DIR holds a GPT attnkit wrote; a config.json
    nested past json's limit once escaped that question as a RecursionError and a traceback."""
    from attnkit.cli import main

    for which in ("gpt", "bert"):
        target = tmp_path / which
        shutil.copytree(originals[which][0], target)
        (target / "config.json").write_text(DEEP)
        assert main(["show", "w1 w2", "--model", str(target), "--out", str(tmp_path / "report"), "--no-images"]) == 2
        err = capsys.readouterr().err
        assert "config.json" in err and "nested too deeply" in err and err.count("\n") == 1, err


def test_a_checksum_nested_too_deep_is_a_valueerror_naming_the_file(originals, tmp_path):
    from attnkit.models.checkpoint import CHECKSUM_KEY

    target = tmp_path / "gpt"
    shutil.copytree(originals["gpt"][0], target)
    stored = safetensors_torch.load_file(str(target / "model.safetensors"))
    metadata = {"format": "pt", CHECKSUM_KEY: DEEP}
    safetensors_torch.save_file(stored, str(target / "model.safetensors"), metadata=metadata)
    with pytest.raises(ValueError, match=rf"model\.safetensors: its metadata {CHECKSUM_KEY} is not valid JSON "
                                         r"\(nested too deeply\)"):
        _load_gpt(target)


def hf_equivalent(ours: str, stored: str | None, tie_word_embeddings: bool) -> bool:
    """Whether attnkit's parameter ``ours`` is the stored tensor ``stored`` (either format; with tied
    embeddings the output layer is the stored embedding matrix too)."""
    if stored is None:
        return False
    tied = tie_word_embeddings and ours == "lm_head.weight" and stored == "model.embed_tokens.weight"
    from attnkit.models.llama_export import hf_name

    return hf_name(ours) == stored or tied or _hf_bert_name_safe(ours) == stored


def _ours(stored: str) -> str | None:
    """attnkit's name for a stored BERT tensor name (None for other names)."""
    from attnkit.models.checkpoint import hf_name_to_attnkit

    try:
        return hf_name_to_attnkit(stored)
    except ValueError:
        return None


def _hf_bert_name_safe(ours: str) -> str | None:
    try:
        return _hf_bert_name(ours)
    except AssertionError:
        return None


# --- point 2: a Llama checkpoint transformers saved with untied embeddings ----------------------------------

def test_a_causal_lm_checkpoint_prints_no_load_report(tmp_path, capfd):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    from attnkit.cli import main

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate("the quick brown fox jumps".split())}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]")
    model.save_pretrained(tmp_path / "llama")
    fast.save_pretrained(tmp_path / "llama")
    capfd.readouterr()  # save_pretrained's progress bar
    assert main(["explain", "the quick fox", "--model", str(tmp_path / "llama"), "--layer", "1"]) == 0
    captured = capfd.readouterr()
    assert "LOAD REPORT" not in captured.out + captured.err and "lm_head" not in captured.out + captured.err
    assert "UNEXPECTED" not in captured.out + captured.err
    assert captured.out.startswith("Layer 1, head ") and "(llama, attention on attnkit)" in captured.out
