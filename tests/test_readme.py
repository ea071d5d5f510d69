"""The README's shown error is the one its Usage's contract gives, every docs/ page the README links to
exists, and its results table is the committed run's. (tests/test_docs_examples.py runs its code.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_error_the_usage_shows_is_the_one_its_contract_gives():
    import torch

    import fastcollate
    from fastcollate import Contract, Field

    usage = README.split("## Usage", 1)[1]
    contract_source = re.search(r"(contract = Contract\(.*?\)\}\))", usage, re.S).group(1)
    scope = {"Contract": Contract, "Field": Field, "torch": torch}
    exec(contract_source, scope)  # the README's own contract
    samples = [{"id": i, "image": torch.zeros((1 if i == 103 else 3, 64, 64), dtype=torch.uint8),
                "label": i % 10} for i in range(100, 104)]
    with pytest.raises(fastcollate.ContractError) as raised:
        fastcollate.assemble.using(scope["contract"])(samples)
    message = f"{raised.type.__name__}: {raised.value}"
    shown = re.search(r"```\n(ContractSizeError:.*?)```", usage, re.S).group(1)
    assert " ".join(shown.split()) == " ".join(message.split())


def test_every_linked_page_exists():
    for link in re.findall(r"\]\((docs/[^)#]+)\)", README):
        assert (ROOT / link).is_file(), link


def test_the_results_table_is_the_committed_run_s():
    """Each row of the README's table is the JSON's figure, rounded as printed: a rerun replaces both."""
    import json

    run = json.loads((ROOT / "benchmarks" / "results" / "hf_ratios-cpu.json").read_text())
    row = r"^\| (packed|tabular), (\d+) [a-z ]+\| ([\d.]+)(M|k) \w+/s \| ([\d.]+)x( ~)? \| ([\d.]+)x( ~)? \|$"
    rows = re.findall(row, README, re.M)
    assert len(rows) == 4
    for case, size, rate, unit, swapped, swapped_mark, arrays, arrays_mark in rows:
        groups = run["cases"][case]["groups"]
        (group,) = [g for g in groups if g["batch_size"] == int(size) and g["workers"] == 0]
        scale = 1e6 if unit == "M" else 1e3
        assert f"{group['HF']['median'] / scale:.{len(rate.partition('.')[2])}f}" == rate
        for shown, mark, path in ((swapped, swapped_mark, "swapped"), (arrays, arrays_mark, "Arrays")):
            assert f"{group[path]['ratio']:.{len(shown.partition('.')[2])}f}" == shown, (case, size, path)
            assert bool(mark) == (not group[path]["clears_noise"]), (case, size, path, "the ~ mark")
