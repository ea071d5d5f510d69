"""pytest-benchmark suite: each case of ``benchmarks.shared.collate_cases`` collated by its
reference (torch's default_collate, or pad_sequence + a Python mask) and by fastcollate.assemble, at one
intra-op thread and at two.

    pytest benchmarks --benchmark-group-by=group          # side by side per case and thread count
    pytest benchmarks --benchmark-skip                      # only the output-equality checks

Ratios against the performance targets come from ``collate_ratios.py`` (interleaved, every repetition kept);
this suite is the quick look. Each batch is dropped before the next call, so assemble's staging ring
stays warm.
"""

from __future__ import annotations

import functools

import pytest
import torch

from benchmarks.shared.collate_cases import CASES, build_case, outputs_equal
from benchmarks.shared.collate_contenders import (
    HF_PAD_SEQUENCE,
    HF_REFERENCE,
    PACKED_CAT,
    PACKED_REFERENCE,
    have_transformers,
)

THREADS = (1, 2)


@functools.cache
def case(key: str):
    return build_case(key)


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def contenders(key: str) -> tuple[str, str]:
    if key == "tokens_padded":
        return ("pad_sequence+mask", "assemble+contract")
    if key == "hf_padded":
        return ((HF_REFERENCE,) if have_transformers() else ()) + (HF_PAD_SEQUENCE, "assemble+contract")
    if key == "packed":
        return ((PACKED_REFERENCE,) if have_transformers() else ()) + (PACKED_CAT, "assemble+contract")
    return ("default_collate", "assemble")


PARAMS = [(key, name) for key in CASES for name in contenders(key)]


@pytest.mark.parametrize("threads", THREADS, indirect=True, ids=lambda n: f"{n}t")
@pytest.mark.parametrize(("key", "contender"), PARAMS, ids=[f"{k}-{n}" for k, n in PARAMS])
def test_collate(benchmark, key, contender, threads):
    c = case(key)
    benchmark.group = f"{key} threads={threads}"
    benchmark.extra_info.update(samples=len(c.samples), nbytes=c.nbytes, tokens=c.tokens, threads=threads)
    fn, samples = c.contenders[contender], c.samples

    def collate_and_drop():
        fn(samples)  # pedantic would keep each result during the next call: drop it, as a training loop does

    benchmark.pedantic(collate_and_drop, rounds=30 if key == "imagenet_uint8" else 200,
                       warmup_rounds=3, iterations=1)


@pytest.mark.parametrize("key", CASES)
def test_assemble_matches_reference(key):
    c = case(key)
    reference = c.contenders[c.reference](c.samples)
    for name in c.checked:
        out = c.contenders[name](c.samples)
        assert outputs_equal(reference, out) == [], name
        del out
