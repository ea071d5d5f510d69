"""The collate benchmark cases: inputs, contenders and targets, built once.

Every case is a list of samples plus the functions that collate it (torch's ``default_collate`` or the
hand-written reference, ``fastcollate.assemble``, the contract-checked ``assemble.using(...)``, and for
the ImageNet case the plain-copy baselines), all producing the same batch. ``collate_ratios.py`` times
them interleaved; ``test_collate.py`` runs them under pytest-benchmark.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import default_collate

try:
    import fastcollate
except ImportError:  # run from a checkout without an install: the package sits one level up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fastcollate

from fastcollate import Contract, Field, assemble

__all__ = [
    "BATCH",
    "CASES",
    "FLOOR",
    "Case",
    "Target",
    "build_case",
    "HF_PAD_SEQUENCE",
    "HF_REFERENCE",
    "PACKED_ARRAYS",
    "PACKED_CAT",
    "PACKED_REFERENCE",
    "build_cases",
    "fashion_mnist_samples",
    "have_transformers",
    "hf_contract",
    "hf_token_samples",
    "imagenet_samples",
    "leaves",
    "outputs_equal",
    "packed_contract",
    "packed_samples",
    "small_fields_samples",
    "token_samples",
]

BATCH = 256
SEED = 0

Collate = Callable[[Sequence[Any]], Any]


@dataclasses.dataclass(frozen=True)
class Target:
    """One performance target, as a ratio of median times of two contenders of a case.

    Args:
        label: what the target asks, in words.
        subject: the contender being judged (``assemble`` or ``assemble+contract``).
        baseline: the contender it is compared with.
        kind: ``"faster"``: baseline / subject must be at least ``bound`` (a speed-up);
            ``"within"``: subject / baseline must be at most ``bound`` (an overhead).
    """

    label: str
    subject: str
    baseline: str
    kind: Literal["faster", "within"]
    bound: float

    def ratio(self, subject_s: float, baseline_s: float) -> float:
        return baseline_s / subject_s if self.kind == "faster" else subject_s / baseline_s

    def met(self, ratio: float) -> bool:
        return ratio >= self.bound if self.kind == "faster" else ratio <= self.bound

    def describe(self) -> str:
        if self.kind == "faster":
            return f"{self.subject} >= {self.bound:g}x faster than {self.baseline}"
        return f"{self.subject} <= {self.bound:g}x {self.baseline}"


@dataclasses.dataclass
class Case:
    """A batch of samples and the contenders that collate it.

    Args:
        key: short name (``small_fields``), used as the benchmark group.
        title: one line for tables.
        samples: the batch, as a DataLoader hands it to ``collate_fn``.
        contenders: name to collate function; the first one is the reference whose output the others
            must equal (leaf by leaf).
        checked: the contenders whose output is compared with the reference (the plain-copy baselines
            move the same number of bytes but build no batch, and are left out).
        nbytes: bytes of the collated batch's tensors (the unit for bytes/s).
        tokens: real (unpadded) tokens in the batch, for variable-length cases.
        repeat: default number of interleaved rounds.
        targets: the performance targets on this case (ratios ``collate_ratios.py`` judges).
        build: makes the same samples again, as new objects (what a Dataset's ``__getitem__`` hands a
            worker's collate_fn before every batch).
    """

    key: str
    title: str
    samples: list
    contenders: dict[str, Collate]
    checked: tuple[str, ...]
    nbytes: int
    tokens: int | None = None
    repeat: int = 200
    targets: list[Target] = dataclasses.field(default_factory=list)
    build: Callable[[], list] | None = None

    @property
    def reference(self) -> str:
        return next(iter(self.contenders))


# ---------------------------------------------------------------------------------------------------
# Sample builders (seeded, reusable on their own).


def small_fields_samples(n: int = BATCH, fields: int = 16, values: int = 8, seed: int = SEED) -> list[dict]:
    """``n`` dicts of ``fields`` float32 tensors of ``values`` elements, plus ``id`` and ``label`` ints."""
    g = torch.Generator().manual_seed(seed)
    # The same key objects in every sample, as a dataset's literal keys are (string constants are shared).
    names = [f"f{k:02d}" for k in range(fields)]
    out = []
    for i in range(n):
        sample: dict[str, Any] = {name: torch.rand(values, generator=g) for name in names}
        sample["id"] = i
        sample["label"] = int(torch.randint(0, 10, (), generator=g))
        out.append(sample)
    return out


def fashion_mnist_samples(n: int = BATCH, seed: int = SEED) -> list[dict]:
    """FashionMNIST after ``ToTensor()``: float32 ``[1, 28, 28]`` image in [0, 1], label in [0, 10), id."""
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "image": torch.rand(1, 28, 28, generator=g),
            "label": int(torch.randint(0, 10, (), generator=g)),
            "id": i,
        }
        for i in range(n)
    ]


def imagenet_samples(n: int = BATCH, seed: int = SEED) -> list[dict]:
    """ImageNet-like decoded crops: uint8 ``[3, 224, 224]`` image, label in [0, 1000), id."""
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "image": torch.randint(0, 256, (3, 224, 224), dtype=torch.uint8, generator=g),
            "label": int(torch.randint(0, 1000, (), generator=g)),
            "id": i,
        }
        for i in range(n)
    ]


def token_samples(
    n: int = BATCH, low: int = 16, high: int = 512, vocab: int = 32000, seed: int = SEED
) -> list[dict]:
    """``{"tokens": int64 [T]}`` with T uniform in ``[low, high]`` (inclusive), seeded."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    return [{"tokens": torch.randint(0, vocab, (length,), generator=g)} for length in lengths]


def hf_token_samples(
    n: int = BATCH, low: int = 16, high: int = 512, vocab: int = 32000, seed: int = SEED
) -> list[dict]:
    """What a tokenizing Dataset hands a BERT-style ``DataCollatorWithPadding``: ``input_ids`` int64 [T]
    with T uniform in ``[low, high]``, ``token_type_ids`` int64 [T] (0 for the first text of the pair,
    1 for the second) and ``labels``, an int in [0, 2). Seeded."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    out = []
    for length in lengths:
        token_type_ids = torch.zeros(length, dtype=torch.int64)
        token_type_ids[int(torch.randint(1, length, (), generator=g)):] = 1
        out.append({
            "input_ids": torch.randint(1, vocab, (length,), generator=g),
            "token_type_ids": token_type_ids,
            "labels": int(torch.randint(0, 2, (), generator=g)),
        })
    return out


def packed_samples(
    n: int = BATCH, low: int = 16, high: int = 2048, vocab: int = 32000, seed: int = SEED
) -> list[dict]:
    """What a tokenizing Dataset hands ``DataCollatorWithFlattening`` for causal-LM fine-tuning:
    ``input_ids`` and ``labels`` (a copy) int64 [T], T uniform in ``[low, high]``. Seeded."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    out = []
    for length in lengths:
        ids = torch.randint(0, vocab, (length,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


# ---------------------------------------------------------------------------------------------------
# Contenders.


def checked_assemble(sample: Any, label_range: tuple[int, int]) -> fastcollate.Assembler:
    """``assemble.using(Contract.infer(sample))`` with a range declared on ``label``: every field's dtype
    and shape, plus a value check on the label (the contract-overhead target, case 5)."""
    contract = Contract.infer(sample)
    fields = dict(contract.fields)
    fields["label"] = dataclasses.replace(fields["label"], range=label_range)
    return assemble.using(Contract(fields=fields, id=contract.id))


def pad_sequence_with_mask(batch: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What people write today for variable-length tokens: ``pad_sequence`` and a mask built in Python.
    Same keys, dtypes and values as ``assemble`` under a ``pad=0`` contract."""
    seqs = [sample["tokens"] for sample in batch]
    tokens = pad_sequence(seqs, batch_first=True, padding_value=0)
    lengths = torch.tensor([len(s) for s in seqs])
    mask = torch.arange(tokens.shape[1])[None] < lengths[:, None]
    return {"tokens": tokens, "tokens_mask": mask, "tokens_lengths": lengths}


HF_REFERENCE = "DataCollatorWithPadding"
HF_PAD_SEQUENCE = "pad_sequence (HF keys)"


def have_transformers() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("transformers", "tokenizers"))


def hf_contract(pad_token_id: int = 0, pad_token_type_id: int = 0) -> Contract:
    """The batch ``DataCollatorWithPadding`` makes, as a contract: input_ids and token_type_ids padded on
    the right, one int64 ``attention_mask`` shared by both (they pad the same dim T), int64 labels."""
    padded = dict(shape=("T",), mask="attention_mask", mask_dtype=torch.int64, lengths=None)
    return Contract(
        {
            "input_ids": Field(dtype=torch.int64, pad=pad_token_id, **padded),
            "token_type_ids": Field(dtype=torch.int64, pad=pad_token_type_id, **padded),
            "labels": Field(kind="number", dtype=torch.int64, range=(0, 2)),
        },
        id=None,
    )


def hf_data_collator() -> Collate:
    """``transformers.DataCollatorWithPadding`` with an offline tokenizer: padding reads only its pad
    token id, padding side and model input names, so a two-word vocabulary is enough."""
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    backend = Tokenizer(WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]",
                                                     unk_token="[UNK]")
    return transformers.DataCollatorWithPadding(tokenizer, return_tensors="pt")


def pad_sequence_hf(batch: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """DataCollatorWithPadding's batch written with ``pad_sequence``: the same keys, dtypes and values,
    the int64 attention_mask from the lengths."""
    input_ids = [sample["input_ids"] for sample in batch]
    lengths = torch.tensor([len(ids) for ids in input_ids])
    padded = pad_sequence(input_ids, batch_first=True, padding_value=0)
    return {
        "input_ids": padded,
        "token_type_ids": pad_sequence([sample["token_type_ids"] for sample in batch], batch_first=True,
                                       padding_value=0),
        "attention_mask": (torch.arange(padded.shape[1])[None] < lengths[:, None]).long(),
        "labels": torch.tensor([sample["labels"] for sample in batch]),
    }


PACKED_REFERENCE = "DataCollatorWithFlattening"
PACKED_CAT = "torch.cat+arange"
PACKED_ARRAYS = "assemble on Arrays"


def packed_contract() -> Contract:
    """``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)``'s batch."""
    tokens = dict(dtype=torch.int64, shape=("T",), pack=True)
    return Contract({"input_ids": Field(**tokens), "labels": Field(**tokens, separator=-100)}, id=None,
                    packing=fastcollate.Packing(seq_idx="seq_idx"))


def flattening_collator() -> Collate:
    import transformers

    return transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)


def cat_arange_packed(batch: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, Any]:
    """The packed batch written by hand with torch ops, no Python per token: the same keys, dtypes and
    values as DataCollatorWithFlattening's."""
    ids = [sample["input_ids"] for sample in batch]
    lengths = torch.tensor([len(x) for x in ids])
    cu_seq_lens = torch.zeros(len(ids) + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=cu_seq_lens[1:])
    starts = cu_seq_lens[:-1].long()
    labels = torch.cat([sample["labels"] for sample in batch])
    labels[starts] = -100
    total = int(cu_seq_lens[-1])
    max_length = int(lengths.max())
    return {
        "input_ids": torch.cat(ids)[None],
        "labels": labels[None],
        "position_ids": (torch.arange(total) - torch.repeat_interleave(starts, lengths))[None],
        "seq_idx": torch.repeat_interleave(torch.arange(len(ids), dtype=torch.int32), lengths)[None],
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max_length,
        "max_length_k": max_length,
    }


class PackedFromArrays:
    """``assemble`` under packed_contract() on the same samples stored as ``Arrays`` columns (``Ragged``
    values and offsets, as a tokenized corpus on disk is): the batch gathered straight from the columns,
    with no sample objects. It ignores the samples it is handed: its batch is the columns' rows 0..n-1."""

    def __init__(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> None:
        lengths = torch.tensor([len(s["input_ids"]) for s in samples])
        offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        columns = {key: fastcollate.Ragged(torch.cat([s[key] for s in samples]), offsets)
                   for key in ("input_ids", "labels")}
        self.batch = fastcollate.Arrays(columns, id_key=None).__getitems__(range(len(samples)))
        self.collate = assemble.using(packed_contract())

    def __call__(self, batch: Any = None) -> Any:
        return self.collate(self.batch)


class ReusedStack:
    """Baseline: ``torch.stack(images, out=reused)``, the images of the batch into one buffer made once."""

    def __init__(self, samples: Sequence[Mapping[str, torch.Tensor]], key: str = "image") -> None:
        self.key = key
        first = samples[0][key]
        self.out = torch.empty((len(samples), *first.shape), dtype=first.dtype)

    def __call__(self, batch: Sequence[Mapping[str, torch.Tensor]]) -> torch.Tensor:
        return torch.stack([sample[self.key] for sample in batch], out=self.out)


class ReusedFlatCopy:
    """Baseline: one contiguous copy of the same number of bytes into a buffer made once.

    ``torch``: ``dst.copy_(src)`` (ATen's copy, parallel over torch's intra-op threads like assemble's);
    ``libc``: one ``memmove`` on the calling thread, through ctypes (no torch dispatch at all).
    """

    def __init__(self, nbytes: int, how: Literal["torch", "libc"] = "torch") -> None:
        self.how = how
        self.nbytes = nbytes
        g = torch.Generator().manual_seed(1)
        self.src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)  # zeros: faulted in now, not in the first call

    def __call__(self, batch: Any = None) -> torch.Tensor:
        if self.how == "torch":
            return self.dst.copy_(self.src)
        ctypes.memmove(self.dst.data_ptr(), self.src.data_ptr(), self.nbytes)
        return self.dst


# ---------------------------------------------------------------------------------------------------
# Output comparison.


def leaves(value: Any, path: str = "") -> dict[str, Any]:
    """Flattens a collated batch into ``path -> leaf`` (dict keys and sequence indices joined by dots)."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(leaves(item, f"{path}.{key}" if path else str(key)))
        return out
    if isinstance(value, (list, tuple)) and not (value and isinstance(value[0], str)):
        out = {}
        for index, item in enumerate(value):
            out.update(leaves(item, f"{path}.{index}" if path else str(index)))
        return out
    return {path: value}


def outputs_equal(expected: Any, got: Any) -> list[str]:
    """The differences between two collated batches (keys, dtypes, shapes, values); empty when equal."""
    a, b = leaves(expected), leaves(got)
    problems = [f"{k}: missing" for k in a.keys() - b.keys()]
    problems += [f"{k}: unexpected" for k in b.keys() - a.keys()]
    for key in sorted(a.keys() & b.keys()):
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            problems.append(f"{key}: {type(x).__name__} != {type(y).__name__}")
        elif isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape:
                problems.append(f"{key}: {x.dtype} {list(x.shape)} != {y.dtype} {list(y.shape)}")
            elif not torch.equal(x, y):
                problems.append(f"{key}: values differ")
        elif x != y:
            problems.append(f"{key}: {x!r} != {y!r}")
    return problems


def _tensor_bytes(batch: Any) -> int:
    return sum(v.nbytes for v in leaves(batch).values() if isinstance(v, torch.Tensor))


# ---------------------------------------------------------------------------------------------------
# The cases.

CASES = ("small_fields", "fashion_mnist", "imagenet_uint8", "tokens_padded", "hf_padded", "packed")
# The plain copy of the batch's bytes into a buffer made once: the floor any collate is measured against.
FLOOR = "copy_ into reused"


def build_case(key: str) -> Case:
    """One benchmark case, with its contenders and targets."""
    if key == "small_fields":
        build = small_fields_samples
        samples = build()
        case = Case(key, "256 dicts x (16 float32[8] + id + label)", samples, {}, (), 0, repeat=400)
        speedup = 5.0
        label_range = (0, 10)
    elif key == "fashion_mnist":
        build = fashion_mnist_samples
        samples = build()
        case = Case(key, "256 x (float32[1,28,28] + label + id)", samples, {}, (), 0, repeat=400)
        speedup = 3.0
        label_range = (0, 10)
    elif key == "imagenet_uint8":
        build = imagenet_samples
        samples = build()
        case = Case(key, "256 x (uint8[3,224,224] + label + id), ring warm", samples, {}, (), 0, repeat=60)
        speedup = 5.0
        label_range = (0, 1000)
    elif key == "tokens_padded":
        build = token_samples
        samples = build()
        contract = Contract({"tokens": Field(dtype=torch.int64, shape=("T",), pad=0)}, id=None)
        case = Case(
            key,
            "256 int64 token seqs, T in [16,512], padded + mask",
            samples,
            {"pad_sequence+mask": pad_sequence_with_mask, "assemble+contract": assemble.using(contract)},
            ("assemble+contract",),
            0,
            tokens=sum(len(s["tokens"]) for s in samples),
            repeat=400,
        )
        case.nbytes = _tensor_bytes(pad_sequence_with_mask(samples))
        case.contenders[FLOOR] = ReusedFlatCopy(case.nbytes, "torch")
        case.build = build
        case.targets = [
            Target("padded: >= 3x pad_sequence + Python mask", "assemble+contract", "pad_sequence+mask",
                   "faster", 3.0)
        ]
        return case
    elif key == "hf_padded":
        return hf_padded_case()
    elif key == "packed":
        return packed_case()
    else:
        raise KeyError(f"unknown case {key!r}; cases: {', '.join(CASES)}")

    case.contenders = {
        "default_collate": default_collate,
        "assemble": assemble,
        "assemble+contract": checked_assemble(samples[0], label_range),
    }
    case.checked = ("assemble", "assemble+contract")
    case.build = build
    case.nbytes = _tensor_bytes(default_collate(samples))
    case.targets = [
        Target(f">= {speedup:g}x default_collate", "assemble", "default_collate", "faster", speedup),
        Target("contract check <= 5% over unchecked", "assemble+contract", "assemble", "within", 1.05),
    ]
    if key == "imagenet_uint8":
        # The plain copies move the images' 38.5 MB; id and label add 4 KiB beside them.
        images = sum(s["image"].nbytes for s in samples)
        case.contenders["stack(out=reused)"] = ReusedStack(samples)
        case.contenders[FLOOR] = ReusedFlatCopy(images, "torch")
        case.contenders["memmove (libc)"] = ReusedFlatCopy(images, "libc")
        case.targets[1:1] = [
            Target("<= 1.3x stack(out=reused)", "assemble", "stack(out=reused)", "within", 1.3),
            Target("<= 1.3x one flat copy_ into reused", "assemble", FLOOR, "within", 1.3),
        ]
    else:
        # Not a target here: the memory-bound floor, so the table shows how far any collate could go.
        if key == "fashion_mnist":
            case.contenders["stack(out=reused)"] = ReusedStack(samples)
        case.contenders[FLOOR] = ReusedFlatCopy(case.nbytes, "torch")
    return case


def hf_padded_case() -> Case:
    """BERT-style pairs as DataCollatorWithPadding batches them (the reference), the same batch from
    pad_sequence, and assemble under hf_contract(). Without transformers the pad_sequence version is
    the reference, and the title says so."""
    samples = hf_token_samples()
    contenders: dict[str, Collate] = {}
    title = "256 BERT-style pairs, T in [16,512]: input_ids + token_type_ids + labels, int64 attention_mask"
    if have_transformers():
        contenders[HF_REFERENCE] = hf_data_collator()
    else:
        title += f" ({HF_REFERENCE} left out: transformers is not installed)"
    contenders[HF_PAD_SEQUENCE] = pad_sequence_hf
    contenders["assemble+contract"] = assemble.using(hf_contract())
    case = Case(
        "hf_padded",
        title,
        samples,
        contenders,
        tuple(name for name in contenders if name != next(iter(contenders))),
        _tensor_bytes(pad_sequence_hf(samples)),
        tokens=sum(len(s["input_ids"]) for s in samples),
        repeat=100,
        build=hf_token_samples,
    )
    case.contenders[FLOOR] = ReusedFlatCopy(case.nbytes, "torch")
    # Bounds below what a 2-core machine measured at one thread
    # (results/collate-hf-padded-tokens-padded-cpu.json): 92.5x DataCollatorWithPadding (tokenizer.pad
    # turns every tensor into a Python list and pads those), 4.4x pad_sequence (2.5x to 8.7x per round).
    case.targets = [
        Target(f"HF: >= 3x {HF_PAD_SEQUENCE}", "assemble+contract", HF_PAD_SEQUENCE, "faster", 3.0),
    ]
    if HF_REFERENCE in contenders:
        case.targets.insert(
            0, Target(f"HF: >= 50x {HF_REFERENCE}", "assemble+contract", HF_REFERENCE, "faster", 50.0)
        )
    return case


def packed_case() -> Case:
    """Causal-LM samples packed as DataCollatorWithFlattening packs them (the reference, when transformers
    is installed), by hand with torch.cat + arange, and by assemble under packed_contract(); the title
    gives the padding packing avoids on the same samples."""
    samples = packed_samples()
    contenders: dict[str, Collate] = {}
    lengths = [len(s["input_ids"]) for s in samples]
    packed, padded = sum(lengths), len(lengths) * max(lengths)
    title = (f"256 causal-LM samples, T in [16,2048]: {packed} tokens packed; padded to the longest "
             f"{padded} ({1 - packed / padded:.0%} padding avoided)")
    if have_transformers():
        contenders[PACKED_REFERENCE] = flattening_collator()
    else:
        title += f" ({PACKED_REFERENCE} left out: transformers is not installed)"
    contenders[PACKED_CAT] = cat_arange_packed
    contenders["assemble+contract"] = assemble.using(packed_contract())
    contenders[PACKED_ARRAYS] = PackedFromArrays(samples)
    case = Case(
        "packed",
        title,
        samples,
        contenders,
        tuple(name for name in contenders if name != next(iter(contenders))),
        _tensor_bytes(cat_arange_packed(samples)) - (len(samples) + 1) * 4,  # cu_seq_lens once, not twice
        tokens=packed,
        repeat=40,
        build=packed_samples,
    )
    case.contenders[FLOOR] = ReusedFlatCopy(case.nbytes, "torch")
    case.targets = [
        Target(f"packed: >= 3x {PACKED_CAT}", "assemble+contract", PACKED_CAT, "faster", 3.0),
        Target("packed: <= 1.5x one flat copy_ into reused", "assemble+contract", FLOOR, "within", 1.5),
    ]
    if PACKED_REFERENCE in contenders:
        case.targets.insert(
            0,
            Target(f"packed: >= 50x {PACKED_REFERENCE}", "assemble+contract", PACKED_REFERENCE, "faster",
                   50.0),
        )
    return case


def build_cases(keys: Sequence[str] = CASES) -> list[Case]:
    return [build_case(key) for key in keys]
