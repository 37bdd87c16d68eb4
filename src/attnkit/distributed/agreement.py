"""Before any exchange, the ranks of a sequence-parallel call check that they agree on the call.

Every rank plans its sends and receives from facts it believes all ranks share (the dtype and
shapes of what travels, the mask, ``causal``, the layout, the block sizes, ...) and computes the
others' keys with its own scale and dropout. Ranks that disagree would exchange messages of
different sizes (an abort inside the backend that Python cannot catch, or a hang) or return
garbage. So each call first runs :func:`attnkit.distributed.agreement.agree`: **one** ``all_gather`` of a fixed-size int64
tensor (``SLOTS`` numbers, 256 bytes a rank) holding

* whether the rank accepted its arguments (a rank whose local checks failed still takes part, so
  that the others raise instead of waiting for it),
* the numbers the call needs from every rank (the shard lengths),
* a 64-bit hash (BLAKE2b) of each fact's canonical text, in a fixed order.

Every rank sees the same gathered tensor, so every rank decides alike: on agreement the call goes
on; otherwise every rank raises the same ``ValueError`` naming the first fact that differs and
what each rank had, e.g. ``ring_attention: the ranks disagree on dtype: rank 0 torch.float32,
rank 1 torch.bfloat16; dtype must be the same on every rank``. Only then, on the error path, a
second small ``all_gather`` (``TEXT_BYTES`` bytes a rank) brings every rank's readable value
of that fact (or the refusing ranks' error messages). A rank whose own checks failed raises its
own error; the others a ``ValueError`` naming it.

Masks are compared by description (:func:`attnkit.distributed.agreement.mask_fact`): their class, their ``repr`` and the
contents of the tensors they hold (document ids, per-sequence lengths, explicit ranges), not by
meaning: two ranks passing ``document([4, 4])`` and ``document(ids=...)`` of the same packing
are told they disagree.
"""

from __future__ import annotations

import hashlib
import typing
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import masks as _masks

__all__ = ["agree", "mask_fact", "Fact"]

#: Numbers a rank contributes to the gather: [accepted (0) or refused (1), DATA numbers, hashes].
SLOTS = 32
#: The numbers the call needs from every rank (the shard length, ...).
DATA = 2
#: The most facts a call compares.
MAX_FACTS = SLOTS - 1 - DATA
#: Bytes of a rank's readable value (or error message) on the error path.
TEXT_BYTES = 1024

#: ``(name, shown, canonical)``: what the message calls it, what it shows of the rank's value, the
#: text whose hash is compared (the shown text when None).
Fact = typing.Tuple[str, object, "str | None"]
Fact.__doc__ = """One fact the ranks of a call must share, ``(name, shown, canonical)``: ``name`` is what
the error message calls it, ``shown`` what it shows of this rank's value, ``canonical`` the text
whose hash :func:`attnkit.distributed.agreement.agree` compares (``str(shown)`` when None).

Example:

    >>> import torch
    >>> from attnkit.distributed.agreement import Fact
    >>> fact: Fact = ("dtype", torch.float32, None)  # compared as the text "dtype=torch.float32"
    >>> name, shown, canonical = fact
    >>> name, shown
    ('dtype', torch.float32)
"""
__test__ = {"Fact": Fact.__doc__}  # a type alias: doctest would not find its example otherwise


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "backslashreplace"), digest_size=8).digest(),
                          "little", signed=True)


def agree(function: str, facts: Sequence[Fact] | BaseException, data: Sequence[int], device: torch.device,
          group: dist.ProcessGroup | None) -> list[list[int]]:
    """Check that every rank of ``group`` called ``function`` with the same ``facts`` (or raise the
    same error on every rank; ``facts`` is the exception when this rank's own checks refused its
    arguments: it is raised here, after the others heard of it). Returns every rank's ``data``
    (``DATA`` ints at most), by rank.

    Every rank of ``group`` must call it (it is a collective: one ``all_gather``, and a second on
    the error path).

    Args:
        function: the call's name, for the messages (``"ring_attention"``).
        facts: this rank's :data:`attnkit.distributed.agreement.Fact` list (in the order the first
            difference is reported; at most ``MAX_FACTS``), or the exception its own checks raised.
        data: numbers the call needs from every rank (at most ``DATA`` ints, e.g. the shard length).
        device: where the gathered tensor lives (the inputs' device; the backend's).
        group: the process group, None for the whole world.

    Returns:
        ``P`` lists, ``data`` of each rank, by rank.

    Raises:
        ValueError: on every rank when the ranks disagree on a fact (naming it and each rank's
            value), or when some rank was refused (naming it and its error).
        BaseException: ``facts`` itself, on the rank that was refused.

    Example:

        One rank (a single-process gloo group), so the ranks agree:

        >>> import os, torch, torch.distributed as dist
        >>> from attnkit import masks
        >>> from attnkit.distributed.agreement import agree, mask_fact
        >>> dist.init_process_group("gloo", init_method="file://" + os.path.abspath("agree_pg"),
        ...                         rank=0, world_size=1)
        >>> facts = [("dtype", torch.float32, None), mask_fact(masks.causal()), ("block_size", 128, None)]
        >>> agree("my_call", facts, [16], torch.device("cpu"), None)  # every rank's data, by rank
        [[16]]
        >>> agree("my_call", ValueError("n must be positive"), [], torch.device("cpu"), None)
        Traceback (most recent call last):
            ...
        ValueError: n must be positive
        >>> dist.destroy_process_group()
    """
    world = dist.get_world_size(group)
    refused = isinstance(facts, BaseException)
    if not refused and len(facts) > MAX_FACTS:
        raise AssertionError(f"{len(facts)} facts, at most {MAX_FACTS} fit")  # a bug in attnkit, the same everywhere
    if len(data) > DATA:
        raise AssertionError(f"{len(data)} data numbers, at most {DATA} fit")
    mine = [1 if refused else 0, *data, *[0] * (DATA - len(data))]
    if not refused:
        mine += [_digest(f"{name}={shown if canonical is None else canonical}") for name, shown, canonical in facts]
    mine += [0] * (SLOTS - len(mine))
    packed = torch.tensor(mine, dtype=torch.int64, device=device)
    every = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(every, packed, group=group)
    rows = [t.tolist() for t in every]

    refusers = [r for r, row in enumerate(rows) if row[0]]
    if refusers:
        text = f"{type(facts).__name__}: {facts}" if refused else ""
        texts = _texts(text, device, group, world)
        if refused:
            raise facts
        said = {texts[r] for r in refusers}
        said = said.pop() if len(said) == 1 else _by_value({r: texts[r] for r in refusers})
        raise ValueError(f"{function}: {_ranks(refusers)} refused {'its' if len(refusers) == 1 else 'their'} "
                         f"arguments ({said}), so every rank refuses the call")

    hashes = [row[1 + DATA:] for row in rows]
    first = next((i for i in range(len(facts)) if len({h[i] for h in hashes}) > 1), None)
    if first is None:
        return [row[1:1 + len(data)] for row in rows]
    name, shown, canonical = facts[first]
    texts = _texts(str(shown), device, group, world)
    if len(set(texts)) == 1:  # the same description, different contents (a mask's tensors)
        texts = [f"{t} [contents {hashes[r][first] & 0xFFFFFFFF:08x}]" for r, t in enumerate(texts)]
    note = _NOTES.get(name, "")
    if name == "method":
        function = "sequence-parallel attention"
    raise ValueError(f"{function}: the ranks disagree on {name}: {_by_value(dict(enumerate(texts)))}; "
                     f"{name} must be the same on every rank{note(texts) if callable(note) else note}")


def _listing(texts: list[str]) -> str:
    return f", got [{', '.join(texts)}] on ranks 0..{len(texts) - 1}"


_NOTES = {
    "block_size": lambda texts: f" (it cuts the messages both ends must agree on){_listing(texts)}",
    "head_groups": lambda texts: f" (the exchanges of each group must match){_listing(texts)}",
    "method": " (ring_attention on some ranks and ulysses_attention on others exchange different messages)",
}


def _texts(text: str, device: torch.device, group, world: int) -> list[str]:
    """Every rank's ``text`` (cut to :data:`TEXT_BYTES` bytes): the error path's second gather."""
    raw = text.encode("utf-8", "backslashreplace")
    if len(raw) > TEXT_BYTES:
        raw = raw[:TEXT_BYTES - 3] + b"..."
    numbers = [len(raw) // 256, len(raw) % 256, *raw]
    mine = torch.tensor(numbers + [0] * (TEXT_BYTES + 2 - len(numbers)), dtype=torch.uint8, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    result = []
    for t in every:
        values = t.cpu().tolist()
        size = values[0] * 256 + values[1]
        result.append(bytes(values[2:2 + size]).decode("utf-8", "replace"))
    return result


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0,2`` or ``ranks 0-5,7``."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ",".join(f"{a}" if a == b else f"{a}-{b}" if b > a + 1 else f"{a},{b}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _by_value(values: dict[int, str]) -> str:
    """``rank 0 X, rank 1 Y``, ranks with the same value together (``ranks 0,2 X, rank 1 Y``)."""
    groups: dict[str, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(value, []).append(rank)
    return ", ".join(f"{_ranks(ranks)} {value}" for value, ranks in groups.items())


def mask_fact(mask: object) -> Fact:
    """The mask as a fact: shown as its ``repr``, compared by class, ``repr`` and the contents of
    the tensors it holds (walking its public attributes, so every structured mask is covered,
    composed ones included; attributes starting with ``_`` are taken for caches and skipped).

    Args:
        mask: a structured mask (:mod:`attnkit.masks`) or None.

    Returns:
        The :data:`attnkit.distributed.agreement.Fact` ``("mask", repr(mask), canonical text)``.

    Example:

        >>> import torch
        >>> from attnkit import masks
        >>> from attnkit.distributed.agreement import mask_fact
        >>> mask_fact(masks.document([4, 4]) & masks.causal())[:2]
        ('mask', 'document([4, 4]) & causal()')
        >>> same = masks.document(ids=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))  # the same packing
        >>> mask_fact(same)[2] == mask_fact(masks.document([4, 4]))[2]  # described otherwise
        False
        >>> mask_fact(masks.document([4, 4]))[2] == mask_fact(masks.document([4, 4]))[2]
        True
        >>> mask_fact(None)
        ('mask', 'None', None)
    """
    if mask is None:
        return ("mask", "None", None)
    return ("mask", repr(mask), _canonical(mask, depth=0))


def _canonical(value: object, depth: int) -> str:
    if depth > 16:
        return "..."
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return repr(value)
    if isinstance(value, Tensor):
        t = value.detach().cpu().contiguous().reshape(-1)
        contents = hashlib.blake2b(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"",
                                   digest_size=16).hexdigest()
        return f"tensor({value.dtype}, {tuple(value.shape)}, {contents})"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[{', '.join(_canonical(v, depth + 1) for v in value)}]"
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda item: repr(item[0]))
        return "{" + ", ".join(f"{k!r}: {_canonical(v, depth + 1)}" for k, v in items) + "}"
    if isinstance(value, _masks.StructuredMask):
        fields = sorted((k, v) for k, v in vars(value).items() if not k.startswith("_"))
        inner = ", ".join(f"{k}={_canonical(v, depth + 1)}" for k, v in fields)
        return f"{type(value).__module__}.{type(value).__qualname__}({inner}; {value!r})"
    return type(value).__qualname__  # no repr: it may hold an address, different on every rank
