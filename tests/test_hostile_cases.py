"""Cases a hostile or unlucky user meets: several rules broken at once in one batch (both paths name the
same one), threads importing the kept module names while the package first loads, a source folder
without its build beside an editable install, and the position ops given a start past int64."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fastcollate import Arrays, Contract, Field, assemble
from fastcollate.collate import gather
from fastcollate.collate.errors import ContractError, ContractValueError
from tests.helpers.processes import run_side_by_side

ROOT = Path(__file__).resolve().parent.parent


def walked_and_gathered(dataset, indices, contract):
    """The error of the walk over ``dataset[i]`` and of the column gather, for the same samples."""
    collate = assemble.using(contract)
    assert gather.gatherer(dataset, contract, "id") is not None, "the dataset is gathered by column"
    with pytest.raises(ContractError) as walked:
        collate([dataset[i] for i in indices])
    with pytest.raises(ContractError) as gathered:
        collate(dataset.__getitems__(indices))
    return walked.value, gathered.value


@pytest.mark.parametrize(
    ("later", "field"),
    [
        (torch.zeros(4, 3, dtype=torch.float64), Field(dtype=torch.float32, shape=(3,))),  # its dtype
        (torch.zeros(4, 4), Field(dtype=torch.float32, shape=(3,))),  # its declared shape
        (torch.zeros(4, 5), Field(dtype=torch.float32, shape=("D",))),  # a named dim the first has as 2
        (torch.zeros(4, dtype=torch.int32), Field(kind="number", dtype=torch.int64)),  # a number's dtype
    ],
)
def test_a_range_broken_in_a_later_sample_of_an_earlier_field_is_named_first_by_both_paths(later, field):
    # The walk checks field by field: x's values in every sample before y's dtype or shape in sample 0.
    x = torch.zeros(4, 2)
    x[2, 0] = float("nan")
    dataset = Arrays(x=x, y=later, index_as="id")
    x_field = Field(dtype=torch.float32, shape=("D",) if field.shape == ("D",) else (2,), range=(-1, 1))
    contract = Contract({"id": Field(kind="number"), "x": x_field, "y": field})
    walked, gathered = walked_and_gathered(dataset, [0, 2], contract)
    assert type(gathered) is type(walked) is ContractValueError
    assert str(gathered) == str(walked)
    assert gathered.field == "x" and gathered.sample_id == 2 and gathered.position == 1


def test_a_later_field_s_dtype_is_still_named_when_the_earlier_field_s_range_holds():
    dataset = Arrays(x=torch.zeros(4, 2), y=torch.zeros(4, 3, dtype=torch.float64), index_as="id")
    contract = Contract({
        "id": Field(kind="number"),
        "x": Field(dtype=torch.float32, shape=(2,), range=(-1, 1)),
        "y": Field(dtype=torch.float32, shape=(3,)),
    })
    walked, gathered = walked_and_gathered(dataset, [1, 3], contract)
    assert str(gathered) == str(walked)
    assert gathered.field == "y" and "expected torch.float32, got torch.float64" in str(gathered)


def run_python(
    code: str, cwd: Path, pythonpath: list[Path], site: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
    flags = [] if site else ["-S"]
    return subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)


def test_threads_importing_old_module_names_while_the_package_first_loads_all_get_the_module(tmp_path):
    # A thread importing fastcollate.errors does not wait for another thread still running
    # fastcollate/__init__.py: the old name must be found then too, as a file at that path always was.
    code = """
        import importlib, threading
        names = ["fastcollate", "fastcollate.errors", "fastcollate.lightning", "fastcollate.audit"]
        start = threading.Barrier(len(names))
        failed = []
        def load(name):
            start.wait()
            try:
                importlib.import_module(name)
            except Exception as error:
                failed.append(f"{name}: {type(error).__name__}: {error}")
        threads = [threading.Thread(target=load, args=(name,)) for name in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "an import is stuck"
        print("\\n".join(failed) or "every import done")
    """
    # Three tries of the race, side by side.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    commands = {n: [sys.executable, "-c", textwrap.dedent(code)] for n in range(3)}
    tries = run_side_by_side(commands, tmp_path, env)
    for done in tries.values():
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == "every import done"


def test_an_unbuilt_source_folder_does_not_borrow_the_compiled_core_an_import_hook_offers(tmp_path):
    # An editable install of another checkout puts a hook on sys.meta_path that finds fastcollate._C in
    # that checkout, whatever folder fastcollate itself came from: this folder's code would run against
    # another build.
    package = tmp_path / "checkout" / "fastcollate"
    shutil.copytree(ROOT / "fastcollate", package, ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    (package.parent / "setup.py").write_text("")
    built = next((ROOT / "fastcollate").glob("_C*.so"))
    code = f"""
        import sys
        import importlib.abc, importlib.machinery, importlib.util
        class LendsTheCore(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name != "fastcollate._C":
                    return None
                loader = importlib.machinery.ExtensionFileLoader(name, {str(built)!r})
                return importlib.util.spec_from_file_location(name, {str(built)!r}, loader=loader)
        sys.meta_path.append(LendsTheCore())
        import fastcollate
        print("imported, with the core at", fastcollate._C.__file__)
    """
    torch_packages = Path(torch.__file__).resolve().parent.parent
    done = run_python(code, tmp_path, [package.parent, torch_packages], site=False)
    assert done.returncode != 0, done.stdout
    assert f"is not built in {package}" in done.stderr.strip().splitlines()[-1]


def test_packed_positions_into_refuses_a_start_whose_positions_would_pass_int64():
    cu_seq_lens = torch.tensor([0, 3, 5], dtype=torch.int32)
    position_ids = torch.zeros(1, 5, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"start must be within \+-2\*\*62.*got 9223372036854775806"):
        torch.ops.fastcollate.packed_positions_into(cu_seq_lens, 2**63 - 2, position_ids, None)
    assert position_ids.eq(0).all(), "nothing written"
    torch.ops.fastcollate.packed_positions_into(cu_seq_lens, 2**62, position_ids, None)
    assert position_ids.tolist() == [[2**62, 2**62 + 1, 2**62 + 2, 2**62, 2**62 + 1]]
    torch.ops.fastcollate.packed_positions_into(cu_seq_lens, -(2**62), position_ids, None)
    assert position_ids[0, 2].item() == -(2**62) + 2
