"""Damaged training checkpoints (the rule "files are untrusted input"): a checkpoint of a tiny run is
damaged one way at a time, by a seeded RNG, and its manifest rewritten to match (a checkpoint written
wrong, not rotted: rot is the crash harness's and the manifest's business, test_checkpoint_atomic.py).
state.json gets a key of its own, of the run's settings or of a parameter group set to a value of
another type or out of range; state.safetensors gets a tensor made NaN, infinite, half precision,
integer, flattened, cut or huge. Resuming must then either raise a ValueError naming the damaged
file (or, for a changed setting, the settings that differ), or run. Any other exception fails: a
run of this kind once found parameter-group settings that torch took unread and that failed only at
the next optimizer step (a TypeError, an AssertionError about CUDA, an unpacking error).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from attnkit.training import TrainConfig, checkpoint, train  # noqa: E402
from test_checkpoint_atomic import reseal  # noqa: E402  the manifest rewritten for the files as they are

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, vocab_size=300,
                seq_len=16, batch_size=2, max_documents=4, eval_rows=2, sample_tokens=0, steps=3, warmup_steps=1,
                eval_interval=2, checkpoint_interval=1, attention_dropout=0.1)
SEED = 26
CASES = 200


def _other_value(rng: random.Random, value):
    """A value of another type or out of range, or one shaped like the record's own lists."""
    return rng.choice([None, "1", [value], {"v": value}, True, False, 0, -1, 1, 2, 3, 10**9, 10**30, -10**30, 1.5,
                       float("nan"), float("inf"), [], {}, [[1, 2.0]], [[1, float("nan")]], [[1, "a"]], [[0, 1.0]],
                       [[1, 1.0], [1, 1.0]], [[2, 1.0]], [{"params": [0]}], [{"params": []}], [{"params": [0, 0]}],
                       [{"params": [10**9]}], [{"params": [-1]}], [0.9, 1.5], [0.9]])


def _damaged_tensor(rng: random.Random, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    how = rng.choice(["nan", "inf", "half", "int", "flat", "cut", "huge"])
    floating = tensor.is_floating_point() and tensor.numel() > 0
    if how in ("nan", "inf") and floating:
        return how, tensor.clone().reshape(-1).index_fill_(0, torch.tensor([0]), float(how)).reshape(tensor.shape)
    if how == "half" and tensor.is_floating_point():
        return how, tensor.half()
    if how == "int":
        return how, tensor.to(torch.int32)
    if how == "flat":
        return how, tensor.reshape(-1)
    if how == "cut":
        return how, torch.tensor(1e30) if tensor.dim() == 0 else tensor[..., :1].contiguous()
    return "huge", torch.full_like(tensor, 1e30) if tensor.is_floating_point() else tensor


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz") / "base"
    train(TrainConfig(out=str(out), **SETTINGS), until=1, quiet=True)
    return out


def test_a_damaged_checkpoint_is_a_named_valueerror_or_a_run(base, tmp_path):
    version = checkpoint.find_checkpoint(base / "checkpoint")
    state = json.loads((version / "state.json").read_text())
    tensors = safetensors_torch.load_file(str(version / "state.safetensors"))
    rng = random.Random(SEED)
    failures, outcomes = [], {"error": 0, "ran": 0}
    for case in range(CASES):
        out = tmp_path / f"case{case}"
        shutil.copytree(base, out)
        target = checkpoint.find_checkpoint(out / "checkpoint")
        if rng.random() < 0.6:
            record = json.loads(json.dumps(state))
            holder = rng.choice([record, record["train_config"], rng.choice(record["param_groups"])])
            key = rng.choice(sorted(holder))
            holder[key] = _other_value(rng, holder[key])
            what, file = f"state.json {key}={holder[key]!r:.60}", "state.json"
            (target / "state.json").write_text(json.dumps(record))
        else:
            changed = dict(tensors)
            name = rng.choice(sorted(changed))
            how, changed[name] = _damaged_tensor(rng, changed[name])
            what, file = f"tensor {how} {name}", "state.safetensors"
            safetensors_torch.save_file(changed, str(target / "state.safetensors"))
        reseal(target)
        try:
            train(TrainConfig(out=str(out), **SETTINGS), resume=True, quiet=True)
        except ValueError as error:
            if file not in str(error) and "other settings" not in str(error):
                failures.append(f"{what}: the error names neither {file} nor the settings: {error}")
            outcomes["error"] += 1
        except Exception as error:  # noqa: BLE001  anything else is the bug under test
            failures.append(f"{what}: {type(error).__name__}: {str(error)[:200]}")
        else:
            outcomes["ran"] += 1
        shutil.rmtree(out)
    assert not failures, f"{len(failures)} of {CASES} cases:\n" + "\n".join(failures)
    assert outcomes["error"] > CASES // 3, outcomes  # the damage did reach the checks


@pytest.mark.parametrize("eps, runs", [(10**30, True), (10**400, False)], ids=["10**30", "10**400"])
def test_an_integer_setting_is_read_as_the_float_it_states(base, tmp_path, eps, runs):
    """JSON has integers: AdamW's eps written as 10**30 reached torch as a Python int, which it took as
    an integer scalar (OverflowError, int64); it is read as the float 1e30, and 10**400, beyond
    float, is refused."""
    out = tmp_path / "run"
    shutil.copytree(base, out)
    version = checkpoint.find_checkpoint(out / "checkpoint")
    record = json.loads((version / "state.json").read_text())
    record["param_groups"][0]["eps"] = eps
    (version / "state.json").write_text(json.dumps(record))
    reseal(version)
    if runs:
        assert train(TrainConfig(out=str(out), **SETTINGS), resume=True, quiet=True).losses
    else:
        with pytest.raises(ValueError, match=r"state\.json.*'param_groups'\[0\]\['eps'\] must be a finite number"):
            train(TrainConfig(out=str(out), **SETTINGS), resume=True, quiet=True)
