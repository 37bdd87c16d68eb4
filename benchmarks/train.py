"""Training and generation throughput of attnkit's GPT, each against a reference run in the same process.

1. Training tokens/s of one GPT (same weights, same batch) whose attention call is
   attnkit.attention (causal), F.scaled_dot_product_attention (nanoGPT's call, enable_gqa), or
   torch.nn.MultiheadAttention. nn.MultiheadAttention cannot apply rotary embeddings between its
   projections and its attention, so there it gets the rotated heads with identity in- and
   out-projections: what a Llama built on it would pay. One step = forward, backward, AdamW.
2. Packed documents (rows of --seq-len, masks.document) vs one document per row padded to the
   longest of its batch, on the Python Language Reference's sections (lengths from a handful of
   tokens to --seq-len: a skewed mix); real (non-padding) tokens trained per second.
3. Generation tokens/s with attnkit's KV cache vs transformers' generate (attn_implementation
   "sdpa") on the exported checkpoint, greedy, batch 1 and 8.

    python benchmarks/train.py [--repeats N] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `common` from this folder, but after the installed packages: this folder's transformers.py (the
# benchmark) must not shadow the transformers library, so the folder Python put first goes last.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE] + [_HERE]
from common import describe_machine, median_times  # noqa: E402

import attnkit  # noqa: E402
from attnkit import masks  # noqa: E402
from attnkit.models.generate import generate  # noqa: E402
from attnkit.models.gpt import GPT, GPTConfig, document_positions, language_model_loss  # noqa: E402
from attnkit.models.llama_export import save_llama  # noqa: E402
from attnkit.training import corpus  # noqa: E402
from attnkit.training.packing import IGNORE, Rows, pack_documents  # noqa: E402


def sdpa_attention(query, key, value, *, mask=None, causal=True, dropout=0.0, generator=None,
                   return_weights=False, backend=None):
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)


def torch_mha_attention(embed_dim: int, heads: int):
    layer = torch.nn.MultiheadAttention(embed_dim, heads, bias=False, batch_first=True)
    with torch.no_grad():
        layer.in_proj_weight.copy_(torch.eye(embed_dim).repeat(3, 1))
        layer.out_proj.weight.copy_(torch.eye(embed_dim))
    layer.requires_grad_(False)

    def run(query, key, value, *, mask=None, causal=True, dropout=0.0, generator=None, return_weights=False,
            backend=None):
        batch, h, length, dim = query.shape
        group = h // key.shape[1]
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        flat = [t.transpose(1, 2).reshape(batch, length, h * dim) for t in (query, key, value)]
        causal_mask = torch.ones(length, length, dtype=torch.bool).triu(1)  # PyTorch: True = ignore
        out, _ = layer(*flat, attn_mask=causal_mask, is_causal=True, need_weights=False)
        return out.view(batch, length, h, dim).transpose(1, 2)

    return run


def train_step(model, optimizer, rows: Rows, packed: bool):
    def step():
        kwargs = {}
        if packed:
            kwargs = dict(mask=masks.document(ids=rows.doc_ids), positions=document_positions(rows.doc_ids))
        loss = language_model_loss(model(rows.inputs, **kwargs), rows.targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def model_config(vocab: int, seq_len: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=352, max_position_embeddings=seq_len)


def attention_contenders(args, tokenizer) -> None:
    vocab = tokenizer.get_vocab_size()
    for seq_len in (128, 512):
        batch = max(1, 2048 // seq_len)
        rows = Rows(torch.randint(0, vocab, (batch, seq_len)), torch.randint(0, vocab, (batch, seq_len)),
                    torch.zeros(batch, seq_len, dtype=torch.long))
        steps = {}
        for name, fn in (("attnkit", attnkit.attention), ("SDPA", sdpa_attention),
                         ("nn.MultiheadAttention", torch_mha_attention(128, 4))):
            torch.manual_seed(0)
            model = GPT(model_config(vocab, seq_len)).train()
            model.set_attention_fn(fn)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            steps[name] = train_step(model, optimizer, rows, packed=False)
        times = median_times(steps, args.repeats)
        tokens = batch * seq_len
        print(f"\n[1] training step, {batch} x {seq_len} tokens, causal")
        print(f"{'attention':<24}{'tokens/s':>10}{'attnkit / it':>14}")
        for name, seconds in times.items():
            print(f"{name:<24}{tokens / seconds:>10,.0f}{seconds / times['attnkit']:>13.2f}x")


def skewed_documents(tokenizer, seq_len: int) -> list[list[int]]:
    docs = corpus.encode_documents(tokenizer, corpus.python_reference_sections())
    return [doc[: seq_len + 1] for doc in docs]


def padded_batches(docs: list[list[int]], batch: int, seed: int) -> list[Rows]:
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    batches = []
    for start in range(0, len(order) - batch + 1, batch):
        chosen = [docs[i] for i in order[start:start + batch]]
        width = max(len(d) - 1 for d in chosen)
        inputs = torch.zeros(batch, width, dtype=torch.long)
        targets = torch.full((batch, width), IGNORE)
        for row, doc in enumerate(chosen):
            inputs[row, :len(doc) - 1], targets[row, :len(doc) - 1] = torch.tensor(doc[:-1]), torch.tensor(doc[1:])
        batches.append(Rows(inputs, targets, torch.zeros_like(inputs)))
    return batches


def packing_vs_padding(args, tokenizer) -> None:
    seq_len, vocab = args.seq_len, tokenizer.get_vocab_size()
    rows_per_step = max(1, 2048 // seq_len)
    docs = skewed_documents(tokenizer, seq_len)
    lengths = torch.tensor([len(d) - 1 for d in docs]).float()
    packed = pack_documents(docs, seq_len)
    padded = padded_batches(docs, 2 * rows_per_step, seed=0)
    packed_batches = [packed.select(slice(i, i + rows_per_step)) for i in range(0, len(packed) - rows_per_step + 1,
                                                                                rows_per_step)]
    torch.manual_seed(0)
    model = GPT(model_config(vocab, seq_len)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    steps = {"packed": [train_step(model, optimizer, rows, True) for rows in packed_batches],
             "padded": [train_step(model, optimizer, rows, False) for rows in padded]}
    real = {"packed": [rows.real_tokens for rows in packed_batches], "padded": [rows.real_tokens for rows in padded]}
    totals = {name: [0, 0.0] for name in steps}  # real tokens, seconds
    for name in steps:  # warm-up
        steps[name][0]()
    # Interleaved, one step of each at a time (order alternating), so load drift hits both alike.
    for index in range(args.layout_steps):
        for name in (("packed", "padded") if index % 2 == 0 else ("padded", "packed")):
            which = index % len(steps[name])
            began = time.perf_counter()
            steps[name][which]()
            totals[name][1] += time.perf_counter() - began
            totals[name][0] += real[name][which]
    samples = {name: (tokens, seconds, args.layout_steps) for name, (tokens, seconds) in totals.items()}
    print(f"\n[2] packed vs padded training, {len(docs)} documents of {int(lengths.min())}-{int(lengths.max())} tokens "
          f"(median {int(lengths.median())}, mean {lengths.mean():.0f}), rows of {seq_len}")
    print(f"{'layout':<34}{'real tokens/s':>14}{'padding':>9}{'steps':>7}")
    rates = {}
    for name, (tokens, seconds, count) in samples.items():
        rates[name] = tokens / seconds
        if name == "packed":
            waste = 1 - packed.real_tokens / packed.inputs.numel()
            label = f"packed, {rows_per_step} rows, masks.document"
        else:
            waste = 1 - sum(r.real_tokens for r in padded) / sum(r.inputs.numel() for r in padded)
            label = f"padded, {2 * rows_per_step} documents to longest"
        print(f"{label:<34}{rates[name]:>14,.0f}{waste:>9.0%}{count:>7}")
    print(f"packed / padded: {rates['packed'] / rates['padded']:.2f}x real tokens/s")


def generation(args, tokenizer) -> None:
    import transformers

    vocab = tokenizer.get_vocab_size()
    torch.manual_seed(0)
    model = GPT(model_config(vocab, 256)).eval()
    with tempfile.TemporaryDirectory() as directory:
        save_llama(model, directory, tokenizer)
        hf = transformers.LlamaForCausalLM.from_pretrained(directory, attn_implementation="sdpa").eval()
    new = 128
    print(f"\n[3] greedy generation, prompt 32 tokens, {new} new tokens")
    print(f"{'batch':<8}{'attnkit tok/s':>15}{'transformers tok/s':>20}{'ratio':>8}")
    for batch in (1, 8):
        prompts = torch.randint(0, vocab, (batch, 32), generator=torch.Generator().manual_seed(batch))
        ours = lambda: generate(model, prompts.tolist(), new)  # noqa: E731
        theirs = lambda: hf.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False,  # noqa: E731
                                     pad_token_id=0)
        with torch.inference_mode():
            assert ours() == theirs()[:, 32:].tolist(), "the two generations differ"
            times = median_times({"attnkit": ours, "transformers": theirs}, max(3, args.repeats // 3))
        rate = {k: batch * new / v for k, v in times.items()}
        print(f"{batch:<8}{rate['attnkit']:>15,.0f}{rate['transformers']:>20,.0f}"
              f"{rate['attnkit'] / rate['transformers']:>7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--seq-len", type=int, default=1024, help="row length (and document cap) in [2]")
    parser.add_argument("--layout-steps", type=int, default=30, help="training steps per layout in [2]")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--only", choices=["1", "2", "3"], default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe_machine())
    tokenizer = corpus.train_tokenizer(corpus.split_documents(corpus.python_reference_sections())[0], 1024)
    for key, part in (("1", attention_contenders), ("2", packing_vs_padding), ("3", generation)):
        if args.only in (None, key):
            part(args, tokenizer)


if __name__ == "__main__":
    main()
