"""The GPT (Llama architecture) against transformers' own LlamaForCausalLM, its KV cache against
full recomputation, packed documents against each document alone, and generation."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit import masks
from attnkit.models.generate import generate, next_token
from attnkit.models.gpt import GPT, GPTConfig, document_positions, language_model_loss
from attnkit.models.llama_export import load_llama, save_llama


# tiny problems: one thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, max_position_embeddings=64, rope_theta=500.0)


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # norms away from 1 so a mis-mapped norm weight would show
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    return model


def tiny_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    tokenizer.train_from_iterator(["the cat sat on the mat", "the dog sat on the log"] * 4, trainer)
    return tokenizer


# --- export to Hugging Face Llama -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    model = tiny_gpt()
    directory = save_llama(model, tmp_path_factory.mktemp("llama"), tokenizer=tiny_tokenizer())
    hf = transformers.LlamaForCausalLM.from_pretrained(str(directory), attn_implementation="eager").eval()
    return model, hf, directory


def test_export_writes_a_llama_directory(exported):
    _, _, directory = exported
    raw = json.loads((directory / "config.json").read_text())
    assert raw["model_type"] == "llama" and raw["architectures"] == ["LlamaForCausalLM"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in directory.iterdir()}


def test_transformers_gives_the_same_logits(exported):
    model, hf, _ = exported
    tokens = torch.randint(0, TINY["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    # Same float32 operations in a different order (fused SDPA vs eager softmax): differences are
    # rounding, ~1e-6 here; the bar is 1e-4.
    assert (ours - theirs).abs().max() <= 1e-4


def test_transformers_gives_the_same_greedy_generation(exported):
    model, hf, _ = exported
    prompt = torch.randint(0, TINY["vocab_size"], (1, 7), generator=torch.Generator().manual_seed(2))
    theirs = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)[0, 7:].tolist()
    assert generate(model, [prompt[0].tolist()], 20)[0] == theirs


def test_transformers_left_padded_batch_matches_ours(exported):
    model, hf, _ = exported
    prompts = [[5, 9, 13], [7, 1, 2, 3, 4, 8, 60], [11]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    theirs = hf.generate(ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert generate(model, prompts, 12) == theirs[:, width:].tolist()


def test_load_llama_reads_the_export_back(exported):
    model, _, directory = exported
    loaded, tokenizer = load_llama(directory)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 9))
    assert torch.equal(loaded(tokens), model(tokens))
    assert tokenizer.decode(tokenizer.encode("the cat sat").ids) == "the cat sat"


def test_transformers_reads_the_tokenizer(exported):
    transformers = pytest.importorskip("transformers")
    _, _, directory = exported
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))
    ours = load_llama(directory)[1]
    assert theirs("the dog sat on the mat")["input_ids"] == ours.encode("the dog sat on the mat").ids


def test_attention_only_models_are_not_exported(tmp_path):
    with pytest.raises(ValueError, match="attention-only"):
        save_llama(GPT(GPTConfig(**TINY, attention_only=True)), tmp_path)


# --- KV cache --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunks", [(40,), (1,) * 40, (13, 1, 1, 20, 5)])
def test_cache_decoding_equals_full_recomputation(chunks):
    model = tiny_gpt()
    tokens = torch.randint(0, TINY["vocab_size"], (2, 40))
    cache = model.new_cache(2, 48)
    with torch.no_grad():
        full = model(tokens)
        pieces, start = [], 0
        for size in chunks:
            pieces.append(model(tokens[:, start:start + size], cache=cache))
            start += size
    assert len(cache[0]) == 40
    # One causal pass and chunked passes differ only by float32 summation order.
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_a_failed_forward_leaves_every_cache_as_it_was():
    model = tiny_gpt()
    cache = model.new_cache(1, 8)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=cache)
        with pytest.raises(ValueError):
            model(torch.tensor([[4, 5]]), cache=cache, mask=torch.ones(1, 1, 1, 99, dtype=torch.bool))
    assert [len(c) for c in cache] == [3, 3]


# --- packed documents ------------------------------------------------------------------------------------

def test_packed_documents_train_as_if_run_one_by_one():
    """A packed row's loss and gradients equal those of its documents run alone (float64, so the
    comparison is tight: only summation order differs)."""
    model = tiny_gpt().double().train()
    lengths = [9, 17, 3, 11]
    stream = torch.randint(0, TINY["vocab_size"], (sum(lengths) + len(lengths),))
    docs, start = [], 0
    for n in lengths:  # each document: n inputs and n targets
        docs.append(stream[start:start + n + 1])
        start += n + 1
    inputs = torch.cat([d[:-1] for d in docs])[None]
    targets = torch.cat([d[1:] for d in docs])[None]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    packed = language_model_loss(model(inputs, mask=masks.document(ids=ids), positions=document_positions(ids)),
                                 targets)
    packed_grads = torch.autograd.grad(packed, list(model.parameters()))

    total = sum(language_model_loss(model(d[None, :-1]), d[None, 1:]) * (len(d) - 1) for d in docs) / sum(lengths)
    alone_grads = torch.autograd.grad(total, list(model.parameters()))
    torch.testing.assert_close(packed, total, atol=1e-12, rtol=1e-12)
    for a, b in zip(packed_grads, alone_grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_document_positions_restart_per_document():
    ids = torch.tensor([[7, 7, 7, 2, 2, 5], [1, 1, 1, 1, 1, 1]])
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


# --- generation ------------------------------------------------------------------------------------------

def test_batched_prompts_of_different_lengths_generate_as_alone():
    model = tiny_gpt(3)
    prompts = [[4, 8, 15], [16, 23, 42, 4, 8, 15, 16, 23], [1]]
    together = generate(model, prompts, 10)
    assert together == [generate(model, [p], 10)[0] for p in prompts]


def test_sampling_is_seeded_and_leaves_the_global_rng_alone():
    model = tiny_gpt(4)
    state = torch.get_rng_state()
    first = generate(model, [[3, 4], [5]], 15, temperature=1.2, top_k=20, top_p=0.9,
                     generator=torch.Generator().manual_seed(7))
    again = generate(model, [[3, 4], [5]], 15, temperature=1.2, top_k=20, top_p=0.9,
                     generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.get_rng_state(), state)
    assert first == again
    other = generate(model, [[3, 4], [5]], 15, temperature=1.2, generator=torch.Generator().manual_seed(8))
    assert other != first


def test_top_k_and_top_p_keep_the_tokens_their_definitions_keep():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    seen_k, seen_p = set(), set()
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        seen_k.add(int(next_token(logits, temperature=1.0, top_k=2, generator=generator)))
        # top_p=0.7: 0.5 alone holds < 0.7, 0.5 + 0.25 >= 0.7, so exactly the first two stay.
        seen_p.add(int(next_token(logits, temperature=1.0, top_p=0.7, generator=generator)))
    assert seen_k == {0, 1} and seen_p == {0, 1}
    assert int(next_token(logits, temperature=1.0, top_p=0.4, generator=generator)) == 0


def test_eos_stops_a_row():
    model = tiny_gpt(5)
    free = generate(model, [[9, 9, 2]], 8)[0]
    stopped = generate(model, [[9, 9, 2]], 8, eos_token_id=free[2])[0]
    assert stopped == free[:free.index(free[2]) + 1]


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_k=0), "top_k"), (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny_gpt(), [[1]], 3, **kwargs)


def test_bad_config_and_tokens_are_refused():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        GPTConfig(**{**TINY, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="tokens must be an integer tensor"):
        tiny_gpt()(torch.zeros(2, 3))


def test_the_attention_call_can_be_swapped():
    model = tiny_gpt()
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs["causal"])
        from attnkit import attention
        return attention(*args, **kwargs)

    tokens = torch.randint(0, TINY["vocab_size"], (1, 5))
    expected = model(tokens)
    model.set_attention_fn(counting)
    assert torch.equal(model(tokens), expected) and calls == [True, True]


def test_tied_embeddings_export_once_and_load_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tiny_gpt(6, tie_word_embeddings=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    save_llama(model, tmp_path)
    safetensors = pytest.importorskip("safetensors.torch")
    assert "lm_head.weight" not in safetensors.load_file(str(tmp_path / "model.safetensors"))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    tokens = torch.randint(0, TINY["vocab_size"], (2, 12))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max() <= 1e-4
        loaded, _ = load_llama(tmp_path)
        assert torch.equal(loaded(tokens), model(tokens))
