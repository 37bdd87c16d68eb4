"""Issue 25's smaller defects: generation's token ids, temperature and pad id; the CLI's learning
rate; transformers' ``attention_dropout=1.0``; ``torch.jit.trace`` of the layers; ``attnkit
explain`` on a GPT that attnkit wrote; the error naming a Llama config's rope scaling."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from attnkit.cli import build_parser, main
from attnkit.models.generate import generate, next_token
from attnkit.models.gpt import GPT, GPTConfig
from attnkit.models.llama_export import gpt_config_from_hf, hf_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=48, max_position_embeddings=64)


def tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **overrides})).eval()


# --- 1. generation ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompts, got", [
    ([[1.5]], "float"),
    ([[3, 4], [2.0]], "float"),
    ([[True]], "bool"),
    ([torch.tensor([1.0, 2.0])], "torch.float32"),
    ([torch.tensor([True])], "torch.bool"),
])
def test_generate_takes_integer_token_ids_only(prompts, got):
    with pytest.raises(TypeError, match=rf"prompts must hold integer token ids, got {got}"):
        generate(tiny_gpt(), prompts, 2)


def test_generate_still_takes_integer_tensors_and_numpy_ids():
    np = pytest.importorskip("numpy")
    model = tiny_gpt()
    expected = generate(model, [[5, 6, 7], [8]], 3)
    assert generate(model, [torch.tensor([5, 6, 7]), [np.int64(8)]], 3) == expected


def test_a_temperature_that_overflows_the_logits_is_greedy():
    model = tiny_gpt()
    greedy = generate(model, [[5, 6, 7], [8]], 4)
    assert generate(model, [[5, 6, 7], [8]], 4, temperature=1e-45, generator=torch.Generator().manual_seed(0)) \
        == greedy


def test_only_the_rows_that_overflow_are_greedy():
    # Row 0 overflows at this temperature (3e8 / 1e-31 > float32's max); row 1's scaled logits are
    # [0, 0.1]: it is still sampled, and both its tokens come up.
    logits = torch.tensor([[3e8, 0.0], [0.0, 1e-32]])
    generator = torch.Generator().manual_seed(0)
    drawn = torch.stack([next_token(logits, temperature=1e-31, generator=generator) for _ in range(200)])
    assert set(drawn[:, 0].tolist()) == {0} and set(drawn[:, 1].tolist()) == {0, 1}


@pytest.mark.parametrize("pad", [-1, TINY["vocab_size"], 1.0, True, None])
def test_pad_token_id_is_checked_up_front(pad):
    with pytest.raises(ValueError, match=r"pad_token_id must be an int in \[0, 300\).*got"):
        generate(tiny_gpt(), [[1, 2], [3]], 2, pad_token_id=pad)
    with pytest.raises(ValueError, match="pad_token_id"):  # also when no row needs padding
        generate(tiny_gpt(), [[1]], 2, pad_token_id=pad)


def test_a_valid_pad_token_id_changes_nothing_for_real_tokens():
    model = tiny_gpt()
    assert generate(model, [[1, 2], [3]], 3, pad_token_id=299) == generate(model, [[1, 2], [3]], 3)


# --- 2. the CLI's learning rate ----------------------------------------------------------------------------

# --threads: torch.set_num_threads takes any count, and the next parallel region tries to start that
# many threads: 100000 ended the process with a segmentation fault where thread creation was refused.
OUT_OF_RANGE = ([("learning-rate", value) for value in ("1e308", "1e5", "0", "-3e-3", "nan", "inf")]
                + [("threads", value) for value in ("100000", "0", "-1", "two")])


@pytest.mark.parametrize("option, value", OUT_OF_RANGE)
def test_train_refuses_an_option_out_of_range_in_one_line(option, value, capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:
        main(["train", "--size", "tiny", "--steps", "1", f"--{option}={value}", "--out", str(tmp_path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"attnkit train: error: argument --{option}:") and value in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # refused before anything ran


def test_train_accepts_learning_rates_up_to_the_documented_bound():
    from attnkit.cli import MAX_LEARNING_RATE

    parser = build_parser()
    for value in ("3e-3", "1", str(MAX_LEARNING_RATE)):
        assert parser.parse_args(["train", "--learning-rate", value]).learning_rate == float(value)
    assert f"{MAX_LEARNING_RATE:g}" in parser._subparsers._group_actions[0].choices["train"].format_help()


def test_train_accepts_threads_up_to_the_cpus_available():
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parser = build_parser()
    assert [parser.parse_args(["train", "--threads", str(n)]).threads for n in (1, cpus)] == [1, cpus]


# --- 3. transformers' attention_dropout=1.0 ---------------------------------------------------------------

def _llama(**config):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    settings = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**settings, **config}))


def test_attention_dropout_one_drops_every_weight_as_eager_does():
    from attnkit.integrations import transformers as _registered  # noqa: F401  registers "attnkit"

    model = _llama(attention_dropout=1.0).train()
    ids = torch.randint(0, 100, (2, 7))
    model.set_attn_implementation("eager")
    eager = model(input_ids=ids, output_attentions=True)
    model.set_attn_implementation("attnkit")
    ours = model(input_ids=ids, output_attentions=True)
    torch.testing.assert_close(ours.logits, eager.logits, atol=1e-4, rtol=0)
    for o, e in zip(ours.attentions, eager.attentions):
        assert o.shape == e.shape == (2, 4, 7, 7)
        assert not o.any() and not e.any()
    ours.logits.sum().backward()  # training still runs


def test_attention_dropout_one_gives_zeros_of_eagers_shape():
    from attnkit.integrations.transformers import attnkit_attention_forward

    module = torch.nn.Module().train()
    query, key, value = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 6)
    output, weights = attnkit_attention_forward(module, query, key, value, None, dropout=1.0)
    assert output.shape == (2, 3, 4, 6) and not output.any() and weights is None
    output, weights = attnkit_attention_forward(module, query, key, value, None, dropout=1.0,
                                                output_attentions=True)
    assert weights.shape == (2, 4, 3, 5) and not weights.any()
    # in eval mode dropout is off: the ordinary attention
    output, _ = attnkit_attention_forward(module.eval(), query, key, value, None, dropout=1.0)
    assert output.abs().sum() > 0


# --- 4. torch.jit.trace of the layers -------------------------------------------------------------------

def _layers():
    from attnkit.nn import MultiHeadAttention, SelfAttention, StackedHeads

    return [
        ("mha", lambda: MultiHeadAttention(16, 4), 3),
        ("mha-gqa-causal", lambda: MultiHeadAttention(16, 4, num_kv_heads=2, causal=True), 3),
        ("self", lambda: SelfAttention(16, 8), 1),
        ("self-causal", lambda: SelfAttention(16, 8, causal=True), 1),
        ("stacked", lambda: StackedHeads(16, 8, 3), 1),
        ("stacked-causal", lambda: StackedHeads(16, 8, 3, causal=True), 1),
    ]


@pytest.mark.parametrize("build, inputs", [(b, n) for _, b, n in _layers()], ids=[name for name, _, _ in _layers()])
def test_layers_trace_with_torch_jit(build, inputs):
    torch.manual_seed(0)
    layer = build().eval()
    example = tuple(torch.randn(2, 5, 16) for _ in range(inputs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings and torch.jit's deprecation notice
        traced = torch.jit.trace(layer, example)
    fresh = tuple(torch.randn(2, 5, 16) for _ in range(inputs))
    expected, got = layer(*fresh), traced(*fresh)
    expected = expected[0] if isinstance(expected, tuple) else expected
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


# --- 5. attnkit explain on a GPT that attnkit wrote -----------------------------------------------------

@pytest.fixture(scope="module")
def gpt_directory(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    from attnkit.models.llama_export import save_llama

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=280, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the cat sat on the mat", "the dog sat on the log"] * 4, trainer)
    return save_llama(tiny_gpt(), tmp_path_factory.mktemp("gpt") / "model", tokenizer=tokenizer)


def test_explain_a_gpt_attnkit_wrote_prints_no_load_report(gpt_directory, capsys):
    pytest.importorskip("transformers")  # where the report came from
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["explain", "the cat sat", "--model", str(gpt_directory), "--layer", "1", "--head", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and not caught, (captured.err, [str(w.message) for w in caught])
    assert "LOAD REPORT" not in captured.out and "lm_head" not in captured.out and "UNEXPECTED" not in captured.out
    assert captured.out.startswith("Layer 1, head 3 of model (attnkit's GPT, Llama architecture) on 'the cat sat'")
    for step in ("queries [", "mask [", "masked_scores [", "weights [", "Reading the weights:"):
        assert step in captured.out, step


def test_explained_weights_are_the_llama_models(gpt_directory):
    transformers = pytest.importorskip("transformers")
    from attnkit.explain import GPTDirectory, checkpoint_steps

    gpt = GPTDirectory(gpt_directory)
    ids = gpt.tokenizer.encode("the cat sat").ids
    hf = transformers.LlamaForCausalLM.from_pretrained(str(gpt_directory), attn_implementation="eager").eval()
    with torch.no_grad():
        eager = hf(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    steps = {s.name: s for s in checkpoint_steps(gpt, "the cat sat", layer=1, head=3)}
    torch.testing.assert_close(steps["weights"].tensor, eager[1][0, 3], atol=1e-5, rtol=0)
    assert steps["weights"].rows == [gpt.tokenizer.id_to_token(i) for i in ids]


def test_a_checkpoint_transformers_saved_still_goes_through_transformers(tmp_path, gpt_directory):
    from attnkit.models.llama_export import written_by_save_llama

    assert written_by_save_llama(gpt_directory)
    model = _llama()
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text((gpt_directory / "tokenizer.json").read_text())
    assert not written_by_save_llama(tmp_path / "hf")


# --- 6. the rope scaling error ---------------------------------------------------------------------------

def _raw(**changes) -> dict:
    return {**json.loads(json.dumps(hf_config(GPTConfig(**TINY)))), **changes}


@pytest.mark.parametrize("changes, named", [
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling.rope_type 'linear'"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling.type 'dynamic'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
     "rope_parameters.rope_type 'yarn'"),
])
def test_the_rope_error_names_the_offending_setting(changes, named):
    with pytest.raises(ValueError, match="not implemented") as raised:
        gpt_config_from_hf(_raw(**changes))
    assert named in str(raised.value) and "'default' is" not in str(raised.value)


def test_plain_rope_is_accepted_under_either_key():
    assert gpt_config_from_hf(_raw(rope_scaling=None)).rope_theta == 10000.0
    assert gpt_config_from_hf(_raw(rope_scaling={"rope_type": "default"})).rope_theta == 10000.0


def test_train_config_refuses_learning_rates_that_would_overflow():
    """The CLI's bound holds for TrainConfig built from Python too (1e308 used to die inside AdamW)."""
    from attnkit.training.trainer import TrainConfig

    for name in ("learning_rate", "min_learning_rate"):
        with pytest.raises(ValueError, match=name):
            TrainConfig(**{name: 1e308})
        with pytest.raises(ValueError, match=name):
            TrainConfig(**{name: float("nan")})
    assert TrainConfig(learning_rate=1e4).learning_rate == 1e4
