"""The collate benchmark cases: inputs, contenders and targets, built once.

Every case is a list of samples plus the functions that collate it (torch's ``default_collate`` or the
hand-written reference, ``fastcollate.assemble``, the contract-checked ``assemble.using(...)``, and for
the ImageNet case the plain-copy baselines), all producing the same batch. ``collate_ratios.py`` times
them interleaved; ``test_collate.py`` runs them under pytest-benchmark. The contenders other than
assemble are ``collate_contenders``'.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch.utils.data import default_collate

from fastcollate import Contract, Field, assemble

from .collate_contenders import (
    HF_PAD_SEQUENCE,
    HF_REFERENCE,
    PACKED_ARRAYS,
    PACKED_CAT,
    PACKED_REFERENCE,
    Collate,
    PackedFromArrays,
    ReusedFlatCopy,
    ReusedStack,
    cat_arange_packed,
    checked_assemble,
    flattening_collator,
    have_transformers,
    hf_contract,
    hf_data_collator,
    packed_contract,
    pad_sequence_hf,
    pad_sequence_with_mask,
)

__all__ = [
    "BATCH",
    "CASES",
    "FLOOR",
    "Case",
    "Target",
    "build_case",
    "build_cases",
    "fashion_mnist_samples",
    "hf_token_samples",
    "imagenet_samples",
    "leaves",
    "outputs_equal",
    "packed_samples",
    "small_fields_samples",
    "token_samples",
]

BATCH = 256
SEED = 0



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


def small_fields_samples(n: int = BATCH, fields: int = 16, values: int = 8, seed: int = SEED,
                         fresh_keys: bool = False) -> list[dict]:
    """``n`` dicts of ``fields`` float32 tensors of ``values`` elements, plus ``id`` and ``label`` ints.

    By default every sample holds the same key objects, as a dataset's literal keys are (string constants
    are shared). ``fresh_keys``: each sample's keys are equal strings made anew, as ``json.loads`` and
    f-strings hand them out record by record."""
    g = torch.Generator().manual_seed(seed)
    names = [f"f{k:02d}" for k in range(fields)]
    out = []
    for i in range(n):
        sample: dict[str, Any] = {name: torch.rand(values, generator=g) for name in names}
        sample["id"] = i
        sample["label"] = int(torch.randint(0, 10, (), generator=g))
        if fresh_keys:
            sample = {key.encode().decode(): value for key, value in sample.items()}  # a new str each
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

CASES = ("small_fields", "small_fields_fresh_keys", "fashion_mnist", "imagenet_uint8", "tokens_padded",
         "hf_padded", "packed")
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
    elif key == "small_fields_fresh_keys":
        build = functools.partial(small_fields_samples, fresh_keys=True)
        samples = build()
        case = Case(key, "256 dicts x (16 float32[8] + id + label), keys made anew in every sample (as "
                    "json.loads makes them)", samples, {}, (), 0, repeat=400)
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
