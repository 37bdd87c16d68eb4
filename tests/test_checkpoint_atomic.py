"""Checkpoints: a save interrupted at any filesystem step leaves a checkpoint that resumes to the
bits of an uninterrupted run, and a damaged checkpoint gives a ValueError naming the file and key.

The crash harness wraps ``checkpoint._fs`` (every write, fsync, mkdir, rename and removal a save
makes goes through it) and fails call number k, for every k of a save. "Killed" fails every later
call as well, as a dead process makes none; "raised" fails only call k (a full disk, Ctrl-C), so
the save's own clean-up runs. Mutant saves (unsafe orderings) show that the harness can fail.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

import safetensors.torch  # noqa: E402

from attnkit.cli import main  # noqa: E402
from attnkit.training import TrainConfig, train  # noqa: E402
from attnkit.training import checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, vocab_size=300,
            seq_len=16, batch_size=2, max_documents=4, eval_rows=2, sample_tokens=0)
# A checkpoint every step, dropout on (so the generator's state matters), 3 steps: the save of
# step 2 is the one interrupted, with step 1's checkpoint before it.
SETTINGS = dict(TINY, steps=3, warmup_steps=1, eval_interval=2, checkpoint_interval=1, attention_dropout=0.1)
OPERATIONS = ("mkdir", "write", "fsync", "replace", "unlink", "rmdir")


class Killed(BaseException):
    """The process died at this filesystem step."""


class Disk:
    """Counts the save's filesystem calls and fails call ``fail_at`` (1-based) with ``error``; a
    failing write first writes half its bytes, as a full disk does. Models a process that stops,
    not a machine that loses power: what was written stays readable, fsynced or not."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_at: int | None = None,
                 error: BaseException | None = None, kill: bool = True) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail_at, self.error, self.kill, self.dead = fail_at, error, kill, False
        for name in OPERATIONS:
            monkeypatch.setattr(checkpoint._fs, name, self._wrap(name, getattr(checkpoint._fs, name)))

    def _wrap(self, name: str, real):
        def call(path, *args):
            if self.dead:
                raise Killed(f"{name} after the kill")
            self.calls.append((name, Path(args[0] if name == "replace" else path).name))  # replace: its target
            if len(self.calls) == self.fail_at:
                self.dead = self.kill
                if name == "write":
                    with open(path, "xb") as file:
                        file.write(args[0][: len(args[0]) // 2])
                raise self.error if self.error is not None else Killed(f"{name} {path}")
            return real(path, *args)
        return call


@pytest.fixture(autouse=True)
def no_fsync(monkeypatch):
    """fsync is what makes a save survive a power cut, which these in-process crashes cannot show;
    at tens of milliseconds a call it is most of their time. (The module's runs do fsync.)"""
    monkeypatch.setattr(checkpoint._fs, "fsync", lambda path: None)


def config(out: Path, **changes) -> TrainConfig:
    return TrainConfig(out=str(out), **{**SETTINGS, **changes})


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def contents(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in checkpoint.FILES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run's final parameters; a run stopped after step 1 (its checkpoint the
    starting point of every crash); and the arguments of the save of step 2, to replay it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same thread count as the tests that resume
    try:
        root = tmp_path_factory.mktemp("runs")
        whole = parameters(train(config(root / "whole"), quiet=True).model)
        train(config(root / "base"), until=1, quiet=True)
        step1 = contents(checkpoint.find_checkpoint(root / "base" / "checkpoint"))
        shutil.copytree(root / "base", root / "capture")
        captured: dict = {}
        real = checkpoint.save_checkpoint

        def capture(directory, **arguments):
            captured.update(arguments)
            return real(directory, **arguments)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(checkpoint, "save_checkpoint", capture)
            train(config(root / "capture"), resume=True, until=2, quiet=True)
        step2 = contents(checkpoint.find_checkpoint(root / "capture" / "checkpoint"))
        assert step1 != step2
    finally:
        torch.set_num_threads(threads)
    return dict(root=root, whole=whole, step1=step1, step2=step2, save=captured)


def fresh_copy(runs, tmp_path: Path, name: str, *, legacy: bool = False) -> Path:
    """A copy of the run stopped after step 1; ``legacy``: its checkpoint in the former flat layout."""
    out = tmp_path / name
    shutil.copytree(runs["root"] / "base", out)
    if legacy:
        folder = out / "checkpoint"
        version = checkpoint.find_checkpoint(folder)
        for file in checkpoint.FILES:
            shutil.copyfile(version / file, folder / file)
        shutil.rmtree(version)
        (folder / checkpoint.CURRENT).unlink()
    return out


def save_step2(runs, out: Path) -> None:
    checkpoint.save_checkpoint(out / "checkpoint", **runs["save"])


def count_calls(runs, tmp_path, monkeypatch, *, legacy: bool = False) -> list[tuple[str, str]]:
    out = fresh_copy(runs, tmp_path, "count", legacy=legacy)
    with monkeypatch.context() as patch:
        disk = Disk(patch)
        save_step2(runs, out)
    return disk.calls


def tidy(folder: Path) -> bool:
    """Only the pointer and the one version it names: no partial version or temporary file left."""
    names = {entry.name for entry in folder.iterdir()}
    return (names == {checkpoint.CURRENT, checkpoint.find_checkpoint(folder).name}
            and not any(folder.parent.glob("checkpoint.*")))


def crash_failures(runs, tmp_path, monkeypatch, save, *, total: int, legacy: bool = False,
                   resume: bool = True, first_only: bool = False) -> list[str]:
    """Kill ``save`` at each of its filesystem calls 1..total; after each, what resuming finds must
    be step 1's or step 2's checkpoint, byte for byte, and (``resume``) training on to the end
    must give the uninterrupted run's parameters bit for bit and leave a tidy checkpoint folder."""
    failures = []
    for k in range(1, total + 1):
        out = fresh_copy(runs, tmp_path, f"kill{k}", legacy=legacy)
        with monkeypatch.context() as patch:
            disk = Disk(patch, fail_at=k)
            try:
                save(runs, out)
            except Killed:
                pass
            else:
                failures.append(f"k={k}: the save was not interrupted")
        where = f"k={k} ({disk.calls[k - 1][0]} {disk.calls[k - 1][1]})" if len(disk.calls) >= k else f"k={k}"
        try:
            found = contents(checkpoint.find_checkpoint(out / "checkpoint"))
            if found not in (runs["step1"], runs["step2"]):
                failures.append(f"{where}: the checkpoint found is neither step 1's nor step 2's")
            elif resume:
                final = parameters(train(config(out), resume=True, quiet=True).model)
                differing = [name for name, value in runs["whole"].items() if not torch.equal(value, final[name])]
                if differing:
                    failures.append(f"{where}: resumed parameters differ: {differing[:3]}")
                elif not tidy(out / "checkpoint"):
                    failures.append(f"{where}: leftovers after the next save: "
                                    f"{sorted(p.name for p in (out / 'checkpoint').iterdir())}")
        except (OSError, ValueError) as error:
            failures.append(f"{where}: {type(error).__name__}: {error}")
        shutil.rmtree(out, ignore_errors=True)
        if failures and first_only:
            break
    return failures


# -- interrupted saves ------------------------------------------------------------------------------


def test_the_save_makes_every_kind_of_filesystem_step(runs, tmp_path, monkeypatch):
    calls = count_calls(runs, tmp_path, monkeypatch)
    assert {name for name, _ in calls} == set(OPERATIONS), calls
    # The one publishing step comes after every write and fsync of the new version's files.
    publish = calls.index(("replace", checkpoint.CURRENT))
    assert all(name in ("unlink", "rmdir") for name, _ in calls[publish + 2:]), calls


def test_a_save_killed_at_any_step_resumes_to_the_same_bits(runs, tmp_path, monkeypatch):
    total = len(count_calls(runs, tmp_path, monkeypatch))
    assert crash_failures(runs, tmp_path, monkeypatch, save_step2, total=total) == []


def test_the_first_save_over_the_former_flat_layout_killed_at_any_step(runs, tmp_path, monkeypatch):
    calls = count_calls(runs, tmp_path, monkeypatch, legacy=True)
    assert ("unlink", "state.json") in calls  # the flat files go once the new layout is published
    assert crash_failures(runs, tmp_path, monkeypatch, save_step2, total=len(calls), legacy=True,
                          resume=False) == []


@pytest.mark.parametrize("error", [KeyboardInterrupt(), OSError(errno.ENOSPC, "No space left on device")],
                         ids=["KeyboardInterrupt", "ENOSPC"])
def test_an_exception_at_any_step_leaves_a_loadable_checkpoint(runs, tmp_path, monkeypatch, error):
    calls = count_calls(runs, tmp_path, monkeypatch)
    publish = calls.index(("replace", checkpoint.CURRENT)) + 1
    for k in range(1, len(calls) + 1):
        out = fresh_copy(runs, tmp_path, f"raise{k}")
        folder = out / "checkpoint"
        with monkeypatch.context() as patch:
            Disk(patch, fail_at=k, error=error, kill=False)
            # Up to the fsync that follows publishing, the error reaches the caller; the clean-up
            # after it is best effort (the save itself succeeded), but Ctrl-C is never swallowed.
            if k <= publish + 1 or isinstance(error, KeyboardInterrupt):
                with pytest.raises(type(error)):
                    save_step2(runs, out)
            else:
                save_step2(runs, out)
        found = checkpoint.find_checkpoint(folder)
        assert contents(found) == (runs["step1"] if k <= publish else runs["step2"]), k
        model, optimizer = copy.deepcopy((runs["save"]["model"], runs["save"]["optimizer"]))
        record = checkpoint.load_checkpoint(folder, model=model, optimizer=optimizer,
                                            generator=torch.Generator(), steps=3)
        assert record["step"] == (1 if k <= publish else 2)
        if k <= publish:  # the save's own clean-up removed its partial version
            assert len([p for p in folder.iterdir() if p.name.startswith("v")]) == 1, k
        save_step2(runs, out)
        assert tidy(folder), (k, sorted(p.name for p in folder.iterdir()))
        shutil.rmtree(out)


def _overwrite_in_place(runs, out: Path) -> None:
    """Mutant: the naive save, writing over the live files."""
    folder = out / "checkpoint"
    for entry in sorted(folder.iterdir()):
        checkpoint._remove_tree(entry)
    arguments = runs["save"]
    tensors = {f"model.{n}": t for n, t in arguments["model"].state_dict().items() if n != "lm_head.weight"}
    state = arguments["optimizer"].state_dict()
    tensors.update({f"optimizer.{i}.{k}": t for i, v in state["state"].items() for k, t in v.items()})
    tensors["generator"] = arguments["generator"].get_state()
    checkpoint._fs.write(folder / "state.safetensors", safetensors.torch.save(tensors))
    record = {**arguments["state"], "param_groups": state["param_groups"]}
    checkpoint._fs.write(folder / "state.json", json.dumps(record).encode())
    checkpoint._fs.write(folder / "tokenizer.json", arguments["tokenizer"].to_str(pretty=True).encode())


def _remove_the_previous_first(runs, out: Path) -> None:
    """Mutant: free the space of the previous checkpoint before writing the next."""
    folder = out / "checkpoint"
    for entry in sorted(folder.iterdir()):
        checkpoint._remove_tree(entry)
    save_step2(runs, out)


@pytest.mark.parametrize("mutant", [_overwrite_in_place, _remove_the_previous_first])
def test_the_harness_catches_an_unsafe_save(runs, tmp_path, monkeypatch, mutant):
    out = fresh_copy(runs, tmp_path, "count")
    with monkeypatch.context() as patch:
        disk = Disk(patch)
        mutant(runs, out)
    assert crash_failures(runs, tmp_path, monkeypatch, mutant, total=len(disk.calls), first_only=True)


# -- what the loader finds --------------------------------------------------------------------------


def test_partial_versions_and_temporary_files_are_never_read_and_are_cleaned_up(runs, tmp_path):
    out = fresh_copy(runs, tmp_path, "leftovers")
    folder = out / "checkpoint"
    published = checkpoint.find_checkpoint(folder)
    partial = folder / "v00000009-0123abcd"  # a later step, all its files there, but no manifest
    shutil.copytree(published, partial)
    (partial / checkpoint.MANIFEST).unlink()
    (folder / "CURRENT.tmp-deadbeef").write_text('{"version": "v00000009-0123abcd"}')
    assert checkpoint.find_checkpoint(folder) == published
    (folder / checkpoint.CURRENT).unlink()  # even without the pointer, a partial version is skipped
    assert checkpoint.find_checkpoint(folder) == published
    save_step2(runs, out)
    assert tidy(folder) and checkpoint.read_state(folder)["step"] == 2


# DEEP: JSON nested past json's recursion limit, which it refuses with a RecursionError, not a ValueError
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("pointer", ["", "{garbled", '{"version": "v00000007-00000000"}', '["v1"]', DEEP])
def test_a_damaged_pointer_falls_back_to_the_newest_complete_version(runs, tmp_path, pointer):
    out = fresh_copy(runs, tmp_path, "pointer")
    save_step2(runs, out)
    folder = out / "checkpoint"
    newest = checkpoint.find_checkpoint(folder)
    older = folder / "v00000001-00000000"
    shutil.copytree(newest, older)
    (folder / checkpoint.CURRENT).write_text(pointer)
    assert checkpoint.find_checkpoint(folder) == newest


def test_the_former_layouts_still_resume(runs, tmp_path):
    flat = fresh_copy(runs, tmp_path, "flat", legacy=True)
    assert checkpoint.find_checkpoint(flat / "checkpoint") == flat / "checkpoint"
    result = train(config(flat), resume=True, quiet=True)
    assert all(torch.equal(runs["whole"][n], t) for n, t in result.model.state_dict().items())
    assert tidy(flat / "checkpoint")
    # The former save, interrupted between its two renames, left only .old and .partial.
    renamed = fresh_copy(runs, tmp_path, "renamed", legacy=True)
    (renamed / "checkpoint").rename(renamed / "checkpoint.old")
    shutil.copytree(renamed / "checkpoint.old", renamed / "checkpoint.partial")
    result = train(config(renamed), resume=True, quiet=True)
    assert all(torch.equal(runs["whole"][n], t) for n, t in result.model.state_dict().items())
    assert tidy(renamed / "checkpoint")


# -- damaged checkpoints ----------------------------------------------------------------------------


def reseal(version: Path) -> None:
    """Rewrite the manifest for the files as they are now: a checkpoint written wrong, not rotted."""
    manifest = json.loads((version / checkpoint.MANIFEST).read_text())
    for name in checkpoint.FILES:
        data = (version / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (version / checkpoint.MANIFEST).write_text(json.dumps(manifest))


def damaged(runs, tmp_path, file: str, change) -> Path:
    out = fresh_copy(runs, tmp_path, "damaged")
    version = checkpoint.find_checkpoint(out / "checkpoint")
    (version / file).write_bytes(change((version / file).read_bytes()))
    reseal(version)
    return out


def edit_state(change):
    def edit(data: bytes) -> bytes:
        record = json.loads(data)
        change(record)
        return json.dumps(record).encode()
    return edit


@pytest.mark.parametrize("change, key", [
    (edit_state(lambda r: r.update(step=-5)), "step"),
    (edit_state(lambda r: r.update(step=7)), "step"),           # beyond the 3 steps configured
    (edit_state(lambda r: r.update(step="1")), "step"),
    (edit_state(lambda r: r.update(step=True)), "step"),
    (edit_state(lambda r: r.pop("losses")), "losses"),
    (edit_state(lambda r: r.update(losses=[])), "losses"),      # the record disagrees with the step
    (edit_state(lambda r: r.update(evals=[[5, 1.0]])), "evals"),
    (edit_state(lambda r: r.update(train_config=[])), "train_config"),
    (edit_state(lambda r: r.update(param_groups=[{"params": ["a"]}])), "param_groups"),
    (edit_state(lambda r: r.update(param_groups=r["param_groups"][:1])), "param_groups"),
    (lambda data: data[: len(data) // 2], "not valid JSON"),
    (lambda data: b"\xff\xfe garbled", "not valid JSON"),
    (lambda data: b"[1, 2]", "JSON object"),
    (lambda data: DEEP.encode(), "not valid JSON \\(nested too deeply\\)"),
    # a group's settings, which torch copies unread and which once failed only at the next step
    (edit_state(lambda r: r["param_groups"][0].update(betas=1.5)), "'betas'"),          # an unpacking error
    (edit_state(lambda r: r["param_groups"][0].update(betas=[0.9, 1.5])), "'betas'"),
    (edit_state(lambda r: r["param_groups"][1].update(eps={})), "'eps'"),               # a TypeError
    (edit_state(lambda r: r["param_groups"][0].update(weight_decay=float("nan"))), "'weight_decay'"),
    (edit_state(lambda r: r["param_groups"][0].update(capturable=2)), "'capturable'"),  # an AssertionError
    (edit_state(lambda r: r["param_groups"][0].update(amsgrad=True)), "'amsgrad'"),     # not built alike
    (edit_state(lambda r: r["param_groups"][0].pop("eps")), "lacks 'eps'"),
    (edit_state(lambda r: r["param_groups"][0].update(extra=3)), "'extra'"),
], ids=["negative", "beyond", "string", "bool", "missing", "short-losses", "evals", "train_config",
        "param-index", "param-groups", "truncated", "garbled", "list", "deep", "betas", "beta-range", "eps",
        "weight-decay", "capturable", "amsgrad", "missing-eps", "extra-setting"])
def test_a_damaged_state_json_is_a_value_error_naming_file_and_key(runs, tmp_path, change, key):
    out = damaged(runs, tmp_path, "state.json", change)
    with pytest.raises(ValueError, match=rf"state\.json.*{key}") as caught:
        train(config(out), resume=True, quiet=True)
    assert not isinstance(caught.value.__cause__, (KeyError, TypeError))


def test_a_huge_step_is_refused_without_building_it(runs, tmp_path):
    """read_state / load_checkpoint without ``steps`` (nothing bounds 'step' but the losses recorded):
    a damaged step of 10**7 is a ValueError naming 'losses', its peak Python allocation a few MiB,
    where the list of steps 1..10**7 it once built to compare takes hundreds (10**9 took the machine)."""
    import tracemalloc

    out = damaged(runs, tmp_path, "state.json", edit_state(lambda r: r.update(step=10**7)))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"state\.json.*'losses' must hold one \[step, loss\] pair for each "
                                             r"of steps 1\.\.10000000"):
            checkpoint.read_state(out / "checkpoint")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB allocated to refuse a step"


def edit_tensors(change):
    def edit(data: bytes) -> bytes:
        tensors = safetensors.torch.load(data)
        change(tensors)
        return safetensors.torch.save(tensors)
    return edit


@pytest.mark.parametrize("change, message", [
    (lambda data: data[: len(data) // 2], "not a readable safetensors"),
    (lambda data: b"\x07" * 64, "not a readable safetensors"),
    (lambda data: b"", "empty"),
    (edit_tensors(lambda t: t.pop("model.norm.weight")), "'model.norm.weight' is missing"),
    (edit_tensors(lambda t: t.pop("generator")), "'generator' is missing"),
    (edit_tensors(lambda t: t.pop("optimizer.3.exp_avg")), "'optimizer.3.exp_avg' is missing"),
    (edit_tensors(lambda t: t.update(extra=torch.zeros(2))), "'extra' is not part"),
    (edit_tensors(lambda t: t.update({"optimizer.99.step": torch.tensor(1.0)})), "'optimizer.99.step' names no"),
    (edit_tensors(lambda t: t.update({"model.norm.weight": torch.zeros(3)})), "'model.norm.weight' has shape"),
    (edit_tensors(lambda t: t.update({"model.norm.weight": t["model.norm.weight"].double()})),
     "'model.norm.weight' has shape"),
    (edit_tensors(lambda t: t.update({"optimizer.0.exp_avg": t["optimizer.0.exp_avg"][:1]})),
     "'optimizer.0.exp_avg' has shape"),
    (edit_tensors(lambda t: t.update(generator=t["generator"][:10])), "'generator' has shape"),
], ids=["truncated", "garbled", "empty", "model-tensor", "generator", "optimizer-tensor", "extra",
        "optimizer-index", "shape", "dtype", "optimizer-shape", "generator-shape"])
def test_a_damaged_state_safetensors_is_a_value_error_naming_file_and_tensor(runs, tmp_path, change, message):
    out = damaged(runs, tmp_path, "state.safetensors", change)
    with pytest.raises(ValueError, match=r"state\.safetensors.*" + message.replace(".", r"\.")):
        train(config(out), resume=True, quiet=True)


def test_a_damaged_tokenizer_is_a_value_error_naming_the_file(runs, tmp_path):
    out = damaged(runs, tmp_path, "tokenizer.json", lambda data: data[:100])
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        train(config(out), resume=True, quiet=True)


@pytest.mark.parametrize("file", checkpoint.FILES)
def test_a_published_file_that_changed_is_reported_not_skipped(runs, tmp_path, file):
    out = fresh_copy(runs, tmp_path, "rot")
    version = checkpoint.find_checkpoint(out / "checkpoint")
    data = bytearray((version / file).read_bytes())
    data[len(data) // 2] ^= 1
    (version / file).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{file.replace('.', chr(92) + '.')}.*SHA-256"):
        train(config(out), resume=True, quiet=True)
    (version / file).write_bytes(bytes(data[:-1]))
    with pytest.raises(ValueError, match=rf"{file.replace('.', chr(92) + '.')}.*bytes"):
        checkpoint.read_state(out / "checkpoint")


@pytest.mark.parametrize("damage, message", [
    ("step", "'step' must be an int >= 0, got -5"),
    ("rot", "SHA-256"),
    ("partial", "no checkpoint to resume from"),
    ("deep-manifest", "not a readable manifest (nested too deeply)"),
])
def test_the_cli_reports_a_damaged_checkpoint_in_one_line(runs, tmp_path, capsys, damage, message):
    if damage == "step":
        out = damaged(runs, tmp_path, "state.json", edit_state(lambda r: r.update(step=-5)))
    else:
        out = fresh_copy(runs, tmp_path, "cli")
        version = checkpoint.find_checkpoint(out / "checkpoint")
        if damage == "rot":
            text = (version / "state.json").read_bytes()
            (version / "state.json").write_bytes(text.replace(b'"step": 1', b'"step": 0'))  # same size
        elif damage == "deep-manifest":  # the published version's manifest, so reported, not skipped
            (version / checkpoint.MANIFEST).write_text(DEEP)
        else:  # only a save cut short is left
            (version / checkpoint.MANIFEST).unlink()
    assert main(["train", "--size", "tiny", "--steps", "3", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
