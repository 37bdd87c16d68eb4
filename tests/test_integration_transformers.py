"""``attn_implementation="attnkit"`` against transformers' own ``"eager"`` attention.

Every model is a tiny random-weight config built here (no download): the same weights run once on
eager and once on attnkit. transformers' eager attention is the independent reference (plain
matmul, softmax, matmul, with each model's own soft-capping, sinks and biases).

Tolerances: fp32 through 2 layers of tiny models whose activations are O(1); eager and attnkit
differ only in summation order (and attnkit's exact -inf where eager adds finfo.min), which stays
~1e-6; 1e-4 (the issue's bound) leaves a wide margin. Weights are probabilities in [0, 1]: 1e-5.
Padded query rows are compared nowhere: attnkit gives them zeros, eager junk (see the module
docstring of attnkit.integrations.transformers).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from attnkit import masks  # noqa: E402
from attnkit.integrations import transformers as integration  # noqa: E402
from transformers.cache_utils import DynamicCache, StaticCache  # noqa: E402

LOGITS = dict(atol=1e-4, rtol=0)
WEIGHTS = dict(atol=1e-5, rtol=0)
VOCAB = 100


def _tiny(name: str) -> torch.nn.Module:
    """A tiny random model of family ``name`` (1-2 layers, hidden 32-64, vocab 100), eval mode."""
    torch.manual_seed(0)
    t = transformers
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=128)
    if name == "bert":
        config = t.BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, **common)
        model = t.BertModel(config)
    elif name == "gpt2":
        config = t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128)
        model = t.GPT2LMHeadModel(config)
    elif name == "llama":
        config = t.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                               num_key_value_heads=2, **common)
        model = t.LlamaForCausalLM(config)
    elif name == "mistral":  # every layer slides a window of 5 over sequences of 20 and more
        config = t.MistralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                 num_key_value_heads=2, sliding_window=5, **common)
        model = t.MistralForCausalLM(config)
    elif name == "qwen2":  # one full and one sliding layer
        config = t.Qwen2Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                               use_sliding_window=True, sliding_window=6,
                               layer_types=["full_attention", "sliding_attention"], **common)
        model = t.Qwen2ForCausalLM(config)
    elif name == "gemma2":  # soft-capping at 5 bites on these scores; a sliding and a full layer
        config = t.Gemma2Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                                final_logit_softcapping=30.0, sliding_window=6, **common)
        model = t.Gemma2ForCausalLM(config)
    elif name == "gpt_oss":  # learned sinks, a sliding and a full layer, a small mixture of experts
        config = t.GptOssConfig(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                                layer_types=["sliding_attention", "full_attention"], **common)
        model = t.GptOssForCausalLM(config)
        with torch.no_grad():  # make the sinks matter: logits around the scores' size
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    elif name == "t5":
        config = t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                            num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0)
        model = t.T5ForConditionalGeneration(config)
    else:
        raise ValueError(name)
    return model.eval()


def _run(model, implementation: str, **inputs):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(**inputs)


def _left_padded(batch: int = 3, length: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (batch, length))
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(1, batch):
        attention_mask[b, :3 * b] = 0  # 0, 3 and 6 padding tokens on the left
    return ids, attention_mask


def _right_padded(batch: int = 3, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(2)
    ids = torch.randint(1, VOCAB, (batch, length))
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(1, batch):
        attention_mask[b, length - 3 * b:] = 0
    return ids, attention_mask


def _assert_weights_match(eager, ours, real_queries: torch.Tensor) -> None:
    """Per layer ``[B, H, Lq, Lk]``: equal on every real query row (padded rows differ, documented)."""
    assert len(eager) == len(ours) and all(w is not None for w in ours)
    for e, o in zip(eager, ours):
        assert e.shape == o.shape
        torch.testing.assert_close(o.transpose(1, 2)[real_queries], e.transpose(1, 2)[real_queries], **WEIGHTS)


DECODERS = ["gpt2", "llama", "mistral", "qwen2", "gemma2", "gpt_oss"]


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_logits_and_weights_match_eager_with_left_padding(name):
    model = _tiny(name)
    ids, attention_mask = _left_padded()
    eager = _run(model, "eager", input_ids=ids, attention_mask=attention_mask, output_attentions=True)
    ours = _run(model, "attnkit", input_ids=ids, attention_mask=attention_mask, output_attentions=True)
    real = attention_mask.bool()
    torch.testing.assert_close(ours.logits[real], eager.logits[real], **LOGITS)
    _assert_weights_match(eager.attentions, ours.attentions, real)


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_with_a_cache_gives_eagers_tokens(name, cache):
    model = _tiny(name)
    ids, attention_mask = _left_padded(length=9)  # prompts of 9, 6, 3 real tokens; 12 new ones pass the windows
    tokens = {}
    for implementation in ("eager", "attnkit"):
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            tokens[implementation] = model.generate(ids, attention_mask=attention_mask, max_new_tokens=12,
                                                    do_sample=False, cache_implementation=cache, pad_token_id=0)
    assert tokens["attnkit"].shape == (3, 21)
    assert torch.equal(tokens["attnkit"], tokens["eager"])


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_chunks_after_a_cache_match_eager(name, cache):
    """A prompt, then a chunk of 4 tokens and one of 1 on the cache (static: keys past the filled
    part exist and must not be attended; windows: a rolling cache)."""
    model = _tiny(name)
    ids, attention_mask = _left_padded(length=16)
    pieces = [(0, 11), (11, 15), (15, 16)]
    logits = {}
    for implementation in ("eager", "attnkit"):
        model.set_attn_implementation(implementation)
        past = DynamicCache(config=model.config) if cache == "dynamic" else StaticCache(config=model.config,
                                                                                       max_cache_len=32)
        out = []
        for start, stop in pieces:
            with torch.no_grad():
                result = model(input_ids=ids[:, start:stop], attention_mask=attention_mask[:, :stop],
                               past_key_values=past, use_cache=True)
            out.append(result.logits)
        logits[implementation] = torch.cat(out, dim=1)
    real = attention_mask.bool()
    torch.testing.assert_close(logits["attnkit"][real], logits["eager"][real], **LOGITS)


def test_bert_hidden_states_and_weights_match_eager_with_right_padding():
    model = _tiny("bert")
    ids, attention_mask = _right_padded()
    eager = _run(model, "eager", input_ids=ids, attention_mask=attention_mask, output_attentions=True)
    ours = _run(model, "attnkit", input_ids=ids, attention_mask=attention_mask, output_attentions=True)
    real = attention_mask.bool()
    torch.testing.assert_close(ours.last_hidden_state[real], eager.last_hidden_state[real], **LOGITS)
    # right padding masks keys only: every query row, padded ones included, matches
    _assert_weights_match(eager.attentions, ours.attentions, torch.ones_like(real))


def test_t5_relative_position_bias_matches_eager_and_generates_the_same_tokens():
    model = _tiny("t5")
    ids, attention_mask = _right_padded()
    decoder_ids = torch.randint(1, VOCAB, (3, 7))
    inputs = dict(input_ids=ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids, output_attentions=True)
    eager = _run(model, "eager", **inputs)
    ours = _run(model, "attnkit", **inputs)
    torch.testing.assert_close(ours.logits, eager.logits, **LOGITS)
    _assert_weights_match(eager.encoder_attentions, ours.encoder_attentions, torch.ones_like(attention_mask.bool()))
    _assert_weights_match(eager.decoder_attentions, ours.decoder_attentions, torch.ones(3, 7, dtype=torch.bool))
    _assert_weights_match(eager.cross_attentions, ours.cross_attentions, torch.ones(3, 7, dtype=torch.bool))
    for cache in ("dynamic", "static"):
        tokens = {}
        for implementation in ("eager", "attnkit"):
            model.set_attn_implementation(implementation)
            with torch.no_grad():
                tokens[implementation] = model.generate(ids, attention_mask=attention_mask, max_new_tokens=8,
                                                        do_sample=False, cache_implementation=cache)
        assert torch.equal(tokens["attnkit"], tokens["eager"]), cache


def _captured_masks(model, **inputs) -> list:
    """The attention_mask argument of every attention call of one attnkit forward."""
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return integration.attnkit_attention_forward(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register("attnkit-spy", spy)
    transformers.masking_utils.AttentionMaskInterface.register("attnkit-spy", integration.attnkit_mask)
    model.set_attn_implementation("attnkit-spy")
    with torch.no_grad():
        model(**inputs)
    return seen


def test_masks_reach_attnkit_as_rules_not_tensors():
    ids, attention_mask = _left_padded(length=24)
    seen = _captured_masks(_tiny("mistral"), input_ids=ids, attention_mask=attention_mask)
    assert len(seen) == 2
    for mask in seen:
        assert isinstance(mask, integration.TransformersMask) and isinstance(mask.mask, masks.StructuredMask)
        assert "sliding_window(5)" in repr(mask.mask)
        expected = masks.sliding_window(5).dense(24) & attention_mask.bool()[:, None, None, :]
        assert torch.equal(mask.dense(), expected)
    # no padding at all: the bare rule
    seen = _captured_masks(_tiny("llama"), input_ids=ids, attention_mask=torch.ones_like(attention_mask))
    assert repr(seen[0].mask) == "causal()"
    # right padding in an encoder: padding(lengths)
    ids, attention_mask = _right_padded()
    seen = _captured_masks(_tiny("bert"), input_ids=ids, attention_mask=attention_mask)
    assert repr(seen[0].mask) == "padding([12, 9, 6])"


def test_a_static_cache_gives_each_query_only_the_filled_keys():
    model = _tiny("llama")
    ids = torch.randint(1, VOCAB, (1, 6))
    past = StaticCache(config=model.config, max_cache_len=16)
    seen = _captured_masks(model, input_ids=ids, past_key_values=past, use_cache=True)
    # 6 queries over 16 keys, the first 6 filled: key_ranges, causal from the top left
    expected = torch.ones(6, 16, dtype=torch.bool).tril()
    assert torch.equal(seen[0].dense()[0, 0], expected)
    assert isinstance(seen[0].mask, masks.StructuredMask)


def test_a_padding_mask_with_holes_is_passed_dense_and_still_matches_eager():
    model = _tiny("llama")
    ids, _ = _left_padded(batch=2, length=10)
    attention_mask = torch.ones(2, 10, dtype=torch.long)
    attention_mask[1, 4] = 0  # a hole: no run of keys describes it
    seen = _captured_masks(model, input_ids=ids, attention_mask=attention_mask)
    assert isinstance(seen[0].mask, torch.Tensor) and seen[0].mask.shape == (2, 1, 10, 10)
    eager = _run(model, "eager", input_ids=ids, attention_mask=attention_mask)
    ours = _run(model, "attnkit", input_ids=ids, attention_mask=attention_mask)
    torch.testing.assert_close(ours.logits, eager.logits, **LOGITS)


def test_dropout_applies_in_training_only_and_follows_the_global_seed():
    model = _tiny("llama")
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    ids, attention_mask = _left_padded(length=10)
    model.set_attn_implementation("attnkit")
    evaluated = _run(model, "attnkit", input_ids=ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    eager = _run(model, "eager", input_ids=ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(evaluated[real], eager[real], **LOGITS)  # eval: no dropout
    model.train()
    model.set_attn_implementation("attnkit")
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        out = model(input_ids=ids, attention_mask=attention_mask, output_attentions=True)
        runs.append(out)
    model.eval()
    assert torch.equal(runs[0].logits, runs[1].logits)
    assert not torch.allclose(runs[0].logits[real], evaluated[real], atol=1e-3)
    weights = runs[0].attentions[0][0]  # sequence 0 has no padding: causal rows
    kept = (weights > 0).float().mean()
    causal_share = (10 * 11 / 2) / 100
    assert 0.3 * causal_share < kept < 0.7 * causal_share  # about half of the attended weights dropped
    runs[0].logits.sum().backward()
    assert all(p.grad is not None for p in model.model.layers[0].self_attn.parameters())


def test_a_feature_attnkit_cannot_express_is_refused_by_name():
    model = _tiny("llama")
    attention = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16)
    kv = torch.randn(1, 2, 3, 16)
    with pytest.raises(ValueError, match="cannot express 'indices'.*LlamaAttention"):
        integration.attnkit_attention_forward(attention, q, kv, kv, None, indices=torch.tensor([0, 1]))


def test_registration_names_attnkit_in_both_interfaces():
    assert transformers.AttentionInterface._global_mapping["attnkit"] is integration.attnkit_attention_forward
    mapping = transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    assert mapping["attnkit"] is integration.attnkit_mask


def test_the_core_never_imports_the_integration_or_transformers():
    import subprocess
    import sys

    code = ("import sys, attnkit, attnkit.nn, attnkit.models; "
            "print(sorted(m for m in sys.modules if m.startswith(('transformers', 'attnkit.integrations'))))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"


def test_a_decoding_step_gets_its_one_row_of_keys_as_a_tensor():
    """One query row (a generated token): its mask is one row of keys per sequence, [B, 1, 1, Lk],
    built once per step for every layer (attnkit would densify the rule for SDPA in each); never
    L x L. A plain causal rule stays a rule (over one row it is no mask)."""
    from transformers import masking_utils

    keep = torch.ones(2, 12, dtype=torch.bool)
    keep[1, :4] = False  # left padding
    step = integration.attnkit_mask(2, 1, 12, q_offset=11, attention_mask=keep)
    assert isinstance(step.mask, torch.Tensor) and step.mask.shape == (2, 1, 1, 12)
    assert torch.equal(step.mask[:, 0, 0], keep)
    window = integration.attnkit_mask(2, 1, 12, q_offset=11, attention_mask=keep,
                                      mask_function=masking_utils.sliding_window_causal_mask_function(5))
    expected = keep & (torch.arange(12) > 11 - 5)
    assert isinstance(window.mask, torch.Tensor) and torch.equal(window.mask[:, 0, 0], expected)
    assert repr(integration.attnkit_mask(2, 1, 12, q_offset=11).mask) == "causal()"
