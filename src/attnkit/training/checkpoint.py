"""Training checkpoints that resume bit for bit (model, AdamW state, dropout generator, step) and
survive being interrupted at any instant of a save.

What a checkpoint holds: ``state.safetensors`` (every tensor: ``model.<name>``,
``optimizer.<index>.<key>`` and ``generator``, the dropout generator's state as bytes),
``state.json`` (the step, the configs, the optimizer's hyper-parameters, the losses so far) and
``tokenizer.json``. The data position is the step itself: which rows a step reads is a pure
function of ``(step, seed)`` (:func:`attnkit.training.packing.batch_order`).

How it is laid out, so that a save killed at any point leaves the new checkpoint or the previous
one (never neither, never a mix)::

    checkpoint/
        CURRENT                       {"version": "v00000300-9f86d081"}: the published checkpoint
        v00000300-9f86d081/           one folder per save, never changed once published
            state.safetensors, state.json, tokenizer.json
            MANIFEST.json             written last: size and SHA-256 of each file

A save (1) writes the files into a fresh version folder and fsyncs each, (2) writes
``MANIFEST.json`` through a temporary name, fsyncs it, renames it into place and fsyncs the
folder: from here on the version is *complete*; (3) publishes it by writing ``CURRENT`` through a
temporary name + fsync + ``os.replace`` + fsync of ``checkpoint/`` (the one atomic step); and
only then (4) removes older versions, leftover partial ones and temporary files. Before (3) the
previous ``CURRENT`` still names the previous version, untouched; after it, the new one. The
loader follows ``CURRENT``; if it is missing or damaged it takes the newest version whose manifest
verifies, so a folder without a manifest (a save cut short) is never read. Every disk-changing
call goes through ``_FileSystem``, one method per step, so the tests fail each in turn.

Older layouts still load: a ``checkpoint/`` holding the three files directly (the first save in
the new layout publishes beside them and removes them afterwards), and the ``checkpoint.old/``
that the former two-rename save could leave behind when interrupted between its renames.

What is read is checked: a damaged, truncated or inconsistent file gives a ``ValueError`` naming
the file and the key or tensor, never a library traceback.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Any

import torch

from .._json import loads_untrusted
from .._optional import require

CURRENT = "CURRENT"
MANIFEST = "MANIFEST.json"
FILES = ("state.safetensors", "state.json", "tokenizer.json")
_FORMAT = 1
_VERSION = re.compile(r"v(\d{8,})-([0-9a-f]{8})")
_TEMPORARY = ".tmp-"
# What the former save left beside the checkpoint when it was interrupted.
_LEGACY_SIBLINGS = (".partial", ".old")


class _FileSystem:
    """Every call by which a save changes the disk, one method per step (the crash test replaces
    them to fail at each step in turn; nothing else in this module writes, renames or removes)."""

    def mkdir(self, path: Path) -> None:
        os.mkdir(path)

    def write(self, path: Path, data: bytes) -> None:
        # "x": a new name every time, so a write never lands in a file that something reads.
        with open(path, "xb") as file:
            file.write(data)

    def fsync(self, path: Path) -> None:
        if os.name == "nt" and path.is_dir():
            return  # Windows cannot open a directory; NTFS journals its entries
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    def replace(self, source: Path, target: Path) -> None:
        os.replace(source, target)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def rmdir(self, path: Path) -> None:
        os.rmdir(path)


_fs = _FileSystem()


# -- saving -----------------------------------------------------------------------------------------


def save_checkpoint(directory: Path, *, model, optimizer, generator: torch.Generator, state: dict, tokenizer) -> Path:
    """Save into a new version folder under ``directory`` and publish it atomically (see the module
    docstring): interrupted at any point, ``directory`` still holds the previous checkpoint or the
    new one. Returns ``directory``.

    Args:
        directory: the checkpoint folder (made if missing).
        model: a :class:`attnkit.models.gpt.GPT` (a tied ``lm_head`` is not stored twice).
        optimizer: its optimizer (AdamW in training); its state and ``param_groups`` are saved.
        generator: the attention dropout's ``torch.Generator``; its state is saved.
        state: what ``state.json`` holds besides the optimizer's ``param_groups``: ``step`` (an
            int >= 0) and whatever else the caller keeps (the trainer: its configs, ``losses``
            and ``evals``, which :func:`attnkit.training.checkpoint.read_state` checks).
        tokenizer: a ``tokenizers.Tokenizer``, saved as ``tokenizer.json``.

    Returns:
        ``directory``, as a ``pathlib.Path``.

    Raises:
        ValueError: ``state['step']`` is not an int >= 0 (before anything is written).
        NotADirectoryError: ``directory`` is a file.
        OSError: the disk refuses (the previous checkpoint stays published).
        ImportError: ``safetensors`` is not installed (naming the extra to install).

    Example:

        >>> import torch
        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> from attnkit.training.checkpoint import save_checkpoint
        >>> from attnkit.training.corpus import train_tokenizer
        >>> model = GPT(GPTConfig(vocab_size=260, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        ...                       num_key_value_heads=1, intermediate_size=32))
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> model(torch.tensor([[1, 2, 3]])).logsumexp(-1).mean().backward()
        >>> optimizer.step()  # one step, so that AdamW has state to save
        >>> state = {"step": 1, "train_config": {}, "losses": [[1, 5.5]], "evals": []}
        >>> folder = save_checkpoint("checkpoint", model=model, optimizer=optimizer, generator=torch.Generator(),
        ...                          state=state, tokenizer=train_tokenizer(["a tiny corpus"], 260))
        >>> import os
        >>> sorted(os.listdir(folder))  # the published version, and the pointer to it
        ['CURRENT', 'v00000001-...']
        >>> version = next(name for name in os.listdir(folder) if name.startswith("v"))
        >>> sorted(os.listdir(folder / version))
        ['MANIFEST.json', 'state.json', 'state.safetensors', 'tokenizer.json']
    """
    safetensors_torch = require("safetensors.torch", "saving checkpoints", extra="models")
    directory = Path(directory)
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"save_checkpoint: state['step'] must be an int >= 0, got {step!r}")
    # Everything is serialized before the disk is touched: an error here leaves nothing behind.
    tensors = {f"model.{name}": tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("model.lm_head.weight")
    optimizer_state = optimizer.state_dict()
    for index, values in optimizer_state["state"].items():
        for key, tensor in values.items():
            tensors[f"optimizer.{index}.{key}"] = tensor.detach().contiguous()
    tensors["generator"] = generator.get_state()
    record = {**state, "param_groups": optimizer_state["param_groups"]}
    payload = {"state.safetensors": safetensors_torch.save(tensors),
               "state.json": (json.dumps(record, indent=2) + "\n").encode("utf-8"),
               "tokenizer.json": tokenizer.to_str(pretty=True).encode("utf-8")}
    manifest = {"format": _FORMAT, "step": step,
                "files": {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                          for name, data in payload.items()}}

    _make_directory(directory)
    version = directory / f"v{step:08d}-{secrets.token_hex(4)}"
    pointer = directory / f"{CURRENT}{_TEMPORARY}{secrets.token_hex(4)}"
    published = False
    try:
        _fs.mkdir(version)
        for name, data in payload.items():
            _fs.write(version / name, data)
            _fs.fsync(version / name)
        _write_durably(version / MANIFEST, _json_bytes(manifest))
        _fs.fsync(version)
        _fs.fsync(directory)  # the version's own entry, before anything names it
        _fs.write(pointer, _json_bytes({"format": _FORMAT, "version": version.name, "step": step}))
        _fs.fsync(pointer)
        _fs.replace(pointer, directory / CURRENT)
        published = True
        _fs.fsync(directory)
    except BaseException:
        if not published:  # best effort: a kill skips this, and the next save removes the rest
            _remove_quietly(version)
            _remove_quietly(pointer)
        raise
    _remove_obsolete(directory, keep=version.name)
    return directory


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode("utf-8")


def _write_durably(path: Path, data: bytes) -> None:
    """``path`` appears whole or not at all: written under a temporary name, fsynced, renamed."""
    temporary = path.with_name(f"{path.name}{_TEMPORARY}{secrets.token_hex(4)}")
    _fs.write(temporary, data)
    _fs.fsync(temporary)
    _fs.replace(temporary, path)


def _make_directory(directory: Path) -> None:
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"checkpoint: {str(directory)!r} is a file, not a checkpoint folder")
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        try:
            _fs.mkdir(path)
        except FileExistsError:
            pass  # made meanwhile by someone else: just as good
        _fs.fsync(path.parent)


def _remove_tree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        manifest = path / MANIFEST
        if manifest.exists():
            _fs.unlink(manifest)  # first: a half-removed version must not look complete
        for child in path.iterdir():
            _remove_tree(child)
        _fs.rmdir(path)
    elif path.exists() or path.is_symlink():
        _fs.unlink(path)


def _remove_quietly(path: Path) -> None:
    try:
        _remove_tree(path)
    except OSError:
        pass  # the next successful save tries again


def _remove_obsolete(directory: Path, *, keep: str) -> None:
    """After publishing: older and partial versions, temporary files, the files of the old flat
    layout, and what the former two-rename save left beside ``directory``. Best effort: the new
    checkpoint is already safe, and whatever stays is retried by the next save."""
    for entry in sorted(directory.iterdir()):
        name = entry.name
        if (name != keep and _VERSION.fullmatch(name)) or _TEMPORARY in name or name in FILES:
            _remove_quietly(entry)
    for suffix in _LEGACY_SIBLINGS:
        _remove_quietly(directory.with_name(directory.name + suffix))


# -- finding and verifying --------------------------------------------------------------------------


def find_checkpoint(directory: Path) -> Path:
    """The folder holding the checkpoint to resume from: the version ``CURRENT`` names; if that is
    missing or damaged, the newest complete version; else ``directory`` itself (the old flat
    layout) or the ``.old`` sibling an interrupted former save left. ``directory`` may also be a
    version folder. Raises ``FileNotFoundError`` when there is none, ``ValueError`` when the
    published version's files do not match its manifest.

    Returns:
        The folder to read (``pathlib.Path``).

    Raises:
        FileNotFoundError: no checkpoint in or beside ``directory``.
        ValueError: the published version is damaged (a file missing or differing from its
            manifest).

    Example:

        >>> import torch
        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> from attnkit.training.checkpoint import save_checkpoint
        >>> from attnkit.training.corpus import train_tokenizer
        >>> model = GPT(GPTConfig(vocab_size=260, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        ...                       num_key_value_heads=1, intermediate_size=32))
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> model(torch.tensor([[1, 2, 3]])).logsumexp(-1).mean().backward()
        >>> optimizer.step()  # one step, so that AdamW has state to save
        >>> state = {"step": 1, "train_config": {}, "losses": [[1, 5.5]], "evals": []}
        >>> folder = save_checkpoint("checkpoint", model=model, optimizer=optimizer, generator=torch.Generator(),
        ...                          state=state, tokenizer=train_tokenizer(["a tiny corpus"], 260))
        >>> from attnkit.training.checkpoint import find_checkpoint
        >>> find_checkpoint("checkpoint").name
        'v00000001-...'
        >>> find_checkpoint("elsewhere")
        Traceback (most recent call last):
            ...
        FileNotFoundError: no checkpoint to resume from: 'elsewhere' holds none
    """
    directory = Path(directory)
    if (directory / MANIFEST).is_file():
        verify_version(directory)
        return directory
    if directory.is_dir():
        named = _read_pointer(directory)
        if named is not None:
            # Published, so complete when it was written: a mismatch now is damage to report,
            # not a half-finished save to step over.
            verify_version(named)
            return named
        for version in _versions_newest_first(directory):
            try:
                verify_version(version)
            except ValueError:
                continue
            return version
        if (directory / "state.json").is_file():
            return directory
    old = directory.with_name(directory.name + ".old")
    if (old / "state.json").is_file():
        return old
    raise FileNotFoundError(f"no checkpoint to resume from: {str(directory)!r} holds none")


def _read_pointer(directory: Path) -> Path | None:
    """The version ``CURRENT`` names, or None when it is missing, unreadable, or names no version."""
    try:
        pointer = loads_untrusted((directory / CURRENT).read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return None
    name = pointer.get("version") if isinstance(pointer, dict) else None
    if not isinstance(name, str) or not _VERSION.fullmatch(name) or not (directory / name / MANIFEST).is_file():
        return None
    return directory / name


def _versions_newest_first(directory: Path) -> list[Path]:
    versions = [(int(match.group(1)), entry.stat().st_mtime_ns, entry) for entry in directory.iterdir()
                if (match := _VERSION.fullmatch(entry.name)) and entry.is_dir()]
    return [entry for *_, entry in sorted(versions, key=lambda item: item[:2], reverse=True)]


def verify_version(version: Path) -> None:
    """Check every file of a version folder against its ``MANIFEST.json``; ``ValueError`` naming the
    first file that is missing or differs.

    Raises:
        ValueError: an unreadable manifest, or a file missing or of another size or SHA-256.

    Example:

        >>> import torch
        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> from attnkit.training.checkpoint import save_checkpoint
        >>> from attnkit.training.corpus import train_tokenizer
        >>> model = GPT(GPTConfig(vocab_size=260, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        ...                       num_key_value_heads=1, intermediate_size=32))
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> model(torch.tensor([[1, 2, 3]])).logsumexp(-1).mean().backward()
        >>> optimizer.step()  # one step, so that AdamW has state to save
        >>> state = {"step": 1, "train_config": {}, "losses": [[1, 5.5]], "evals": []}
        >>> folder = save_checkpoint("checkpoint", model=model, optimizer=optimizer, generator=torch.Generator(),
        ...                          state=state, tokenizer=train_tokenizer(["a tiny corpus"], 260))
        >>> from attnkit.training.checkpoint import find_checkpoint, verify_version
        >>> version = find_checkpoint("checkpoint")
        >>> verify_version(version)  # silent: every file matches
        >>> with open(version / "state.json", "a") as file:
        ...     _ = file.write(" ")
        >>> verify_version(version)
        Traceback (most recent call last):
            ...
        ValueError: '.../state.json': ... bytes, but the manifest says ...: the checkpoint is damaged
    """
    path = version / MANIFEST
    try:
        manifest = loads_untrusted(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{str(path)!r}: not a readable manifest ({error})") from error
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or set(files) != set(FILES):
        raise ValueError(f"{str(path)!r}: 'files' must list exactly {', '.join(FILES)}")
    for name in FILES:
        expected, file = files[name], version / name
        if not (isinstance(expected, dict) and isinstance(expected.get("size"), int)
                and isinstance(expected.get("sha256"), str)):
            raise ValueError(f"{str(path)!r}: files[{name!r}] must hold 'size' (int) and 'sha256' (str)")
        try:
            data = file.read_bytes()
        except OSError as error:
            raise ValueError(f"{str(file)!r}: missing from the checkpoint ({error})") from error
        if len(data) != expected["size"]:
            raise ValueError(f"{str(file)!r}: {len(data)} bytes, but the manifest says {expected['size']}: "
                             "the checkpoint is damaged")
        if hashlib.sha256(data).hexdigest() != expected["sha256"]:
            raise ValueError(f"{str(file)!r}: its SHA-256 differs from the manifest's: the checkpoint is damaged")


# -- reading ----------------------------------------------------------------------------------------


def read_state(directory: Path, *, steps: int | None = None) -> dict:
    """``state.json`` of the checkpoint in ``directory``, checked: every key the trainer reads is
    present, of its type and in range (``step`` at most ``steps`` when given); else ``ValueError``
    naming the file and the key. ``FileNotFoundError`` when there is no checkpoint.

    Args:
        directory: the checkpoint folder (found as :func:`attnkit.training.checkpoint.find_checkpoint`
            does).
        steps: the run's steps, or None.

    Returns:
        The ``state.json`` object (a dict): ``step``, ``train_config``, ``losses``, ``evals``,
        ``param_groups`` and what else was saved.

    Example:

        >>> import torch
        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> from attnkit.training.checkpoint import save_checkpoint
        >>> from attnkit.training.corpus import train_tokenizer
        >>> model = GPT(GPTConfig(vocab_size=260, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        ...                       num_key_value_heads=1, intermediate_size=32))
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> model(torch.tensor([[1, 2, 3]])).logsumexp(-1).mean().backward()
        >>> optimizer.step()  # one step, so that AdamW has state to save
        >>> state = {"step": 1, "train_config": {}, "losses": [[1, 5.5]], "evals": []}
        >>> folder = save_checkpoint("checkpoint", model=model, optimizer=optimizer, generator=torch.Generator(),
        ...                          state=state, tokenizer=train_tokenizer(["a tiny corpus"], 260))
        >>> from attnkit.training.checkpoint import read_state
        >>> record = read_state("checkpoint")
        >>> record["step"], record["losses"], sorted(record)
        (1, [[1, 5.5]], ['evals', 'losses', 'param_groups', 'step', 'train_config'])
        >>> read_state("checkpoint", steps=0)
        Traceback (most recent call last):
            ...
        ValueError: '.../state.json': 'step' is 1, beyond the 0 steps configured
    """
    path = find_checkpoint(directory) / "state.json"
    try:
        record = loads_untrusted(path.read_bytes().decode("utf-8"))
    except ValueError as error:  # not UTF-8, not JSON, nested too deeply
        raise ValueError(f"{str(path)!r}: not valid JSON ({error})") from error
    _check_state(record, str(path), steps)
    return record


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and not (isinstance(value, float) and math.isinf(value))


def _check_state(record: Any, path: str, steps: int | None) -> None:
    if not isinstance(record, dict):
        raise ValueError(f"{path!r}: must hold a JSON object, got {type(record).__name__}")
    for key in ("step", "train_config", "losses", "evals", "param_groups"):
        if key not in record:
            raise ValueError(f"{path!r}: key {key!r} is missing")
    step = record["step"]
    if not _is_int(step) or step < 0:
        raise ValueError(f"{path!r}: 'step' must be an int >= 0, got {step!r}")
    if steps is not None and step > steps:
        raise ValueError(f"{path!r}: 'step' is {step}, beyond the {steps} steps configured")
    if not isinstance(record["train_config"], dict):
        raise ValueError(f"{path!r}: 'train_config' must be an object, got {record['train_config']!r:.80}")

    def pairs(key: str) -> list[int]:
        value = record[key]
        if not isinstance(value, list) or not all(
                isinstance(pair, list) and len(pair) == 2 and _is_int(pair[0]) and _is_number(pair[1])
                for pair in value):
            raise ValueError(f"{path!r}: {key!r} must be a list of [step, loss] pairs, got {value!r:.80}")
        return [pair[0] for pair in value]

    # One training loss per step taken: anything else means the record and the step disagree. The count
    # first, so that a damaged step (10**9, with no `steps` to bound it) is not built as a list to compare.
    losses = pairs("losses")
    if len(losses) != step or losses != list(range(1, step + 1)):
        raise ValueError(f"{path!r}: 'losses' must hold one [step, loss] pair for each of steps 1..{step}")
    evaluated = pairs("evals")
    if any(not 1 <= s <= step for s in evaluated) or evaluated != sorted(set(evaluated)):
        raise ValueError(f"{path!r}: 'evals' must name increasing steps within 1..{step}, got {evaluated}")
    groups = record["param_groups"]
    if not isinstance(groups, list) or not all(
            isinstance(group, dict) and isinstance(group.get("params"), list)
            and all(_is_int(index) for index in group["params"]) for group in groups):
        raise ValueError(f"{path!r}: 'param_groups' must be a list of objects with integer 'params', "
                         f"got {groups!r:.80}")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    safetensors_torch = require("safetensors.torch", "loading checkpoints", extra="models")
    try:
        data = path.read_bytes()
    except FileNotFoundError as error:
        raise ValueError(f"{str(path)!r}: missing from the checkpoint") from error
    if not data:
        raise ValueError(f"{str(path)!r}: the file is empty")
    try:
        return safetensors_torch.load(data)
    # SafetensorError derives from Exception alone; the others are what torch raises on a bad dtype.
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"{str(path)!r}: not a readable safetensors file ({error})") from error


def load_checkpoint(directory: Path, *, model, optimizer, generator: torch.Generator,
                    steps: int | None = None) -> dict:
    """Restore ``model``, ``optimizer`` and ``generator`` in place from the checkpoint in
    ``directory``; returns its checked ``state.json`` (see
    :func:`attnkit.training.checkpoint.read_state`). A tensor missing, extra, or of another shape
    or dtype than ``model``/``optimizer`` need: ``ValueError``.

    Args:
        directory: the checkpoint folder.
        model, optimizer, generator: what :func:`attnkit.training.checkpoint.save_checkpoint`
            saved, built alike (the same sizes, parameter groups and kind of optimizer).
        steps: the run's steps, or None (see :func:`attnkit.training.checkpoint.read_state`).

    Raises:
        FileNotFoundError: no checkpoint.
        ValueError: a damaged checkpoint, or one that does not fit ``model`` and ``optimizer``.
        ImportError: ``safetensors`` is not installed (naming the extra to install).

    Example:

        >>> import torch
        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> from attnkit.training.checkpoint import save_checkpoint
        >>> from attnkit.training.corpus import train_tokenizer
        >>> model = GPT(GPTConfig(vocab_size=260, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        ...                       num_key_value_heads=1, intermediate_size=32))
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> model(torch.tensor([[1, 2, 3]])).logsumexp(-1).mean().backward()
        >>> optimizer.step()  # one step, so that AdamW has state to save
        >>> state = {"step": 1, "train_config": {}, "losses": [[1, 5.5]], "evals": []}
        >>> folder = save_checkpoint("checkpoint", model=model, optimizer=optimizer, generator=torch.Generator(),
        ...                          state=state, tokenizer=train_tokenizer(["a tiny corpus"], 260))
        >>> from attnkit.training.checkpoint import load_checkpoint
        >>> again = GPT(model.config)  # other random weights
        >>> again_optimizer = torch.optim.AdamW(again.parameters())
        >>> record = load_checkpoint("checkpoint", model=again, optimizer=again_optimizer,
        ...                          generator=torch.Generator())
        >>> record["step"], all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
        (1, True)
        >>> again_optimizer.state_dict()["state"][0]["step"]
        tensor(1.)
    """
    folder = find_checkpoint(directory)
    record = read_state(folder, steps=steps)
    json_path, path = str(folder / "state.json"), folder / "state.safetensors"
    tensors = _read_tensors(path)
    where = str(path)

    groups = record["param_groups"]
    if len(groups) != len(optimizer.param_groups) or any(
            len(saved["params"]) != len(live["params"]) for saved, live in zip(groups, optimizer.param_groups)):
        raise ValueError(f"{json_path!r}: 'param_groups' has groups of "
                         f"{[len(g['params']) for g in groups]} parameters; the optimizer has "
                         f"{[len(g['params']) for g in optimizer.param_groups]}")
    _check_hyperparameters(groups, optimizer, json_path)
    parameters = {index: parameter for saved, live in zip(groups, optimizer.param_groups)
                  for index, parameter in zip(saved["params"], live["params"])}
    if len(parameters) != sum(len(g["params"]) for g in groups):
        raise ValueError(f"{json_path!r}: 'param_groups' repeats a parameter index")
    amsgrad = {index: bool(saved.get("amsgrad")) for saved in groups for index in saved["params"]}

    expected = {f"model.{name}": (t.shape, t.dtype) for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("model.lm_head.weight")
    generator_state = generator.get_state()
    expected["generator"] = (generator_state.shape, generator_state.dtype)
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    optimizer_state: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if not name.startswith("optimizer."):
            if name not in expected:
                raise ValueError(f"{where!r}: tensor {name!r} is not part of this model")
            continue
        parts = name.split(".", 2)
        if len(parts) != 3 or not parts[1].isdigit() or int(parts[1]) not in parameters:
            raise ValueError(f"{where!r}: tensor {name!r} names no parameter of the optimizer")
        index, key = int(parts[1]), parts[2]
        parameter = parameters[index]
        if adam:
            if key == "step":
                if tensor.dim() != 0 or not tensor.is_floating_point():
                    raise ValueError(f"{where!r}: tensor {name!r} must be a floating-point scalar, "
                                     f"got shape {tuple(tensor.shape)} and {tensor.dtype}")
            elif key in ("exp_avg", "exp_avg_sq") or (key == "max_exp_avg_sq" and amsgrad[index]):
                if tensor.shape != parameter.shape or tensor.dtype != parameter.dtype:
                    raise ValueError(f"{where!r}: tensor {name!r} has shape {tuple(tensor.shape)} and "
                                     f"{tensor.dtype}; its parameter has {tuple(parameter.shape)} and "
                                     f"{parameter.dtype}")
            else:
                raise ValueError(f"{where!r}: tensor {name!r} is not part of {type(optimizer).__name__}'s state")
        optimizer_state.setdefault(index, {})[key] = tensor
    for name, (shape, dtype) in expected.items():
        if name not in tensors:
            raise ValueError(f"{where!r}: tensor {name!r} is missing")
        if tensors[name].shape != shape or tensors[name].dtype != dtype:
            raise ValueError(f"{where!r}: tensor {name!r} has shape {tuple(tensors[name].shape)} and "
                             f"{tensors[name].dtype}; this model needs {tuple(shape)} and {dtype}")
    if adam:
        # A parameter has all of AdamW's state or none (none: it never had a gradient).
        for index, values in optimizer_state.items():
            needed = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad[index] else set())
            for key in sorted(needed - set(values)):
                raise ValueError(f"{where!r}: tensor 'optimizer.{index}.{key}' is missing")

    weights = {name[len("model."):]: t for name, t in tensors.items() if name.startswith("model.")}
    if model.config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    try:
        model.load_state_dict(weights)
        optimizer.load_state_dict({"state": optimizer_state, "param_groups": groups})
        generator.set_state(tensors["generator"])
    # Shapes, dtypes and names are checked above; this is for what only torch knows to refuse.
    except (RuntimeError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{where!r}: does not fit this model and optimizer ({error})") from error
    return record


def _is_real(value: Any) -> bool:
    """An int, or a finite float (math.isnan of an int past float's range raises OverflowError)."""
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _check_hyperparameters(groups: list, optimizer, json_path: str) -> None:
    """Each saved parameter group's settings against the live optimizer's group, before torch takes
    them: ``load_state_dict`` copies them unread, and a damaged one only failed at the next step, as
    a TypeError (``eps: {}``), an AssertionError (``capturable: 2`` on the CPU) or an unpacking error
    (``betas: 1.5``). Flags (bool or None in the live group) must equal the optimizer's (the same
    kind of optimizer, built alike), or be absent (torch fills them in) or unknown to this torch
    version; numbers must be finite and >= 0, ``betas`` in [0, 1), lists as long as the optimizer's.
    An integer where the optimizer holds a float is stored in ``groups`` as that float: torch would
    take it as an integer scalar (``eps`` 10**30 overflowed int64)."""
    for i, (saved, live) in enumerate(zip(groups, optimizer.param_groups)):
        where = f"{json_path!r}: 'param_groups'[{i}]"
        for key in sorted(set(saved) | set(live)):
            if key in ("params", "param_names"):
                continue
            flag = key not in live or isinstance(live[key], bool) or live[key] is None
            if key not in saved:
                if not flag:
                    raise ValueError(f"{where} lacks {key!r}")
                continue
            value, expected = saved[key], live.get(key)
            if flag:
                if value is not None and not isinstance(value, bool):
                    raise ValueError(f"{where}[{key!r}] must be true, false or null, got {value!r:.60}")
                if key in live and value != expected:
                    raise ValueError(f"{where}[{key!r}] is {value!r}; this {type(optimizer).__name__} has {expected!r}")
            elif isinstance(expected, (tuple, list)):
                if not (isinstance(value, list) and len(value) == len(expected) and all(
                        _is_real(x) and (0 <= x < 1 if key == "betas" else x >= 0) for x in value)):
                    bound = "in [0, 1)" if key == "betas" else ">= 0"
                    raise ValueError(f"{where}[{key!r}] must be a list of {len(expected)} numbers {bound}, "
                                     f"got {value!r:.60}")
            elif _is_real(expected) or isinstance(expected, torch.Tensor):  # a tensor lr: a number in JSON
                if not (_is_real(value) and 0 <= value <= sys.float_info.max):
                    raise ValueError(f"{where}[{key!r}] must be a finite number >= 0, got {value!r:.60}")
                if isinstance(expected, float) and not isinstance(value, float):
                    saved[key] = float(value)  # torch takes an int as an integer: eps 10**30 overflowed int64
            elif value != expected:
                raise ValueError(f"{where}[{key!r}] is {value!r:.60}; this {type(optimizer).__name__} has {expected!r}")


def read_tokenizer(directory: Path):
    """The checkpoint's ``tokenizers.Tokenizer``; ``ValueError`` naming the file if unreadable.

    Raises:
        FileNotFoundError: no checkpoint in ``directory``.
        ValueError: ``tokenizer.json`` is missing or unreadable.
        ImportError: ``tokenizers`` is not installed (naming the extra to install).

    Example:

        >>> import torch
        >>> from attnkit.models.gpt import GPT, GPTConfig
        >>> from attnkit.training.checkpoint import save_checkpoint
        >>> from attnkit.training.corpus import train_tokenizer
        >>> model = GPT(GPTConfig(vocab_size=260, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        ...                       num_key_value_heads=1, intermediate_size=32))
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> model(torch.tensor([[1, 2, 3]])).logsumexp(-1).mean().backward()
        >>> optimizer.step()  # one step, so that AdamW has state to save
        >>> state = {"step": 1, "train_config": {}, "losses": [[1, 5.5]], "evals": []}
        >>> folder = save_checkpoint("checkpoint", model=model, optimizer=optimizer, generator=torch.Generator(),
        ...                          state=state, tokenizer=train_tokenizer(["a tiny corpus"], 260))
        >>> from attnkit.training.checkpoint import read_tokenizer
        >>> tokenizer = read_tokenizer("checkpoint")
        >>> tokenizer.get_vocab_size(), tokenizer.decode(tokenizer.encode("a tiny corpus").ids)
        (260, 'a tiny corpus')
    """
    tokenizers = require("tokenizers", "resuming training", extra="models")
    path = find_checkpoint(directory) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{str(path)!r}: missing from the checkpoint")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    # The tokenizers library raises a bare Exception for a malformed file.
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"{str(path)!r}: not a readable tokenizer ({error})") from error
