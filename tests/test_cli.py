"""The command line as a user meets it: bad input to ``bench``, ``profile`` and ``doctor`` is answered in
one stderr line naming the argument, exit status 2, no traceback unless ``--debug``; ``--version``; the
``fastcollate`` console script.

The cases a user types first run in a subprocess, as the user runs them; the rest call the dispatcher
in-process (each subprocess pays torch's import) and read the same three things: status, stdout, stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fastcollate
from fastcollate.__main__ import main as dispatch
from fastcollate.tools.cli import UsageError, at_least, loading, output_folder
from tests.conftest import CUDA
from tests.helpers.processes import run_side_by_side

pytestmark = pytest.mark.usefixtures("brief_busy_sample")  # no test here reads the machine's load

ROOT = Path(__file__).resolve().parent.parent
SMALL_BENCH = ["--preset", "fields", "--size", "64", "--no-progress"]  # should validation let one through

FACTORIES = '''
from torch.utils.data import Dataset


class Records(Dataset):
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return {"id": index, "x": float(index)}


def raises():
    raise RuntimeError("no data under /data/records\\nset DATA_ROOT to the folder that holds them")


def empty():
    return Records(0)


def without_dataset():
    return {"batch_size": 8}


def without_step():
    return {"dataset": Records(32)}


def a_number():
    return 42


class NoLength(Dataset):
    def __getitem__(self, index):
        return {"id": index}


def without_len():
    return NoLength()
'''


@pytest.fixture(scope="module")
def factories(tmp_path_factory) -> str:
    """A file of user factories, as ``--dataset path/to/file.py:name`` names them (one file for the
    module: the import system keeps a module by its name)."""
    path = tmp_path_factory.mktemp("user") / "cli_factories.py"
    path.write_text(textwrap.dedent(FACTORIES))
    return str(path)


CONSOLE_SCRIPT = Path(sys.executable).parent / "fastcollate"

# The runs in a subprocess, as a user types them: ``python -m fastcollate ARGS``, or the console script's.
RUNS: dict[str, tuple[str, ...]] = {
    "bench, no such module": ("bench", "--dataset", "nosuch:thing"),
    "bench, negative workers": ("bench", *SMALL_BENCH, "--workers", "0", "-1"),
    "profile, negative workers": ("profile", "--preset", "fields", "--size", "64", "--workers", "-2"),
    "doctor, no such module": ("doctor", "nosuch:thing"),
    "--debug after the command": ("bench", "--dataset", "nosuch:thing", "--debug"),
    "--debug before the command": ("--debug", "bench", "--dataset", "nosuch:thing"),
    "--version": ("--version",),
    "no such preset": ("bench", "--preset", "nosuch"),
    "no such command": ("nosuch",),
}
SCRIPT_RUNS = {
    "console script --version": ("--version",),
    "console script doctor": ("doctor", "nosuch:thing"),
}


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess]:
    """Every run of RUNS (and of SCRIPT_RUNS where the console script is installed), each in a fresh
    interpreter, side by side: {name: its CompletedProcess}."""
    commands = {name: [sys.executable, "-m", "fastcollate", *args] for name, args in RUNS.items()}
    if CONSOLE_SCRIPT.exists():
        commands |= {name: [str(CONSOLE_SCRIPT), *args] for name, args in SCRIPT_RUNS.items()}
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout's package, also for the console script
    return run_side_by_side(commands, cwd=ROOT, env=env)


def assert_one_line_usage_error(status: int, out: str, err: str, verb: str, argument: str, *words: str):
    """Status 2, nothing run (stdout empty), stderr one line ``<verb>: <argument>: ...`` holding ``words``."""
    assert "Traceback" not in err, err
    assert status == 2, (status, out, err)
    assert out == "", "nothing should run on bad input"
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{verb}: {argument}: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])


def in_process(capsys, *args: str) -> tuple[int, str, str]:
    status = dispatch(list(args))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# --- in a subprocess: one bad input per verb, --debug, --version, the console script ----------------


def test_bench_with_a_module_that_does_not_exist_says_so_in_one_line(runs):
    result = runs["bench, no such module"]
    assert_one_line_usage_error(
        result.returncode, result.stdout, result.stderr, "bench", "--dataset",
        "cannot load nosuch:thing", "ModuleNotFoundError", "No module named 'nosuch'",
    )


def test_bench_with_negative_workers_names_the_argument_before_any_loader_starts(runs):
    result = runs["bench, negative workers"]
    assert_one_line_usage_error(
        result.returncode, result.stdout, result.stderr, "bench", "--workers", "at least 0", "got -1"
    )


def test_profile_answers_bad_input_the_same_way(runs):
    result = runs["profile, negative workers"]
    assert_one_line_usage_error(
        result.returncode, result.stdout, result.stderr, "profile", "--workers", "got -2"
    )


def test_doctor_answers_bad_input_the_same_way(runs):
    result = runs["doctor, no such module"]
    assert_one_line_usage_error(
        result.returncode, result.stdout, result.stderr, "doctor", "factory",
        "cannot load nosuch:thing", "No module named 'nosuch'",
    )


@pytest.mark.parametrize("where", ["after the command", "before the command"])
def test_debug_shows_the_traceback_with_its_cause(where, runs):
    result = runs[f"--debug {where}"]
    assert result.returncode not in (0, 2), "an uncaught exception's status, not a usage error's"
    assert "Traceback" in result.stderr
    assert "ModuleNotFoundError: No module named 'nosuch'" in result.stderr, "the cause is shown"
    assert result.stderr.rstrip().endswith("UsageError: --dataset: cannot load nosuch:thing: "
                                           "ModuleNotFoundError: No module named 'nosuch'")


def test_version_prints_the_package_version_and_exits_0(runs):
    result = runs["--version"]
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"fastcollate {fastcollate.__version__}\n"


def test_the_console_script_is_declared_and_answers_like_python_dash_m(runs):
    # Read as text: tomllib is 3.11's, and the package supports 3.10.
    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    assert 'fastcollate = "fastcollate.__main__:main"' in scripts.splitlines()
    if not CONSOLE_SCRIPT.exists():
        pytest.skip(f"the package is not installed in this environment (no {CONSOLE_SCRIPT})")
    assert runs["console script --version"].stdout == f"fastcollate {fastcollate.__version__}\n"
    result = runs["console script doctor"]
    assert_one_line_usage_error(
        result.returncode, result.stdout, result.stderr, "doctor", "factory", "nosuch"
    )


def test_argparse_keeps_its_own_answer_for_a_preset_that_does_not_exist(runs):
    result = runs["no such preset"]
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("usage: python -m fastcollate bench")
    assert "error: argument --preset: invalid choice: 'nosuch'" in result.stderr.splitlines()[-1]


def test_an_unknown_command_exits_2_with_the_usage(runs):
    result = runs["no such command"]
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("unknown command 'nosuch'") and "commands:" in result.stderr


# --- in-process: every kind of bad input a verb checks ----------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--batch-size", "0", ["at least 1", "got 0"]),
        ("--steps", "0", ["at least 1", "got 0"]),
        ("--warmup", "-1", ["at least 0", "got -1"]),
        ("--repeat", "0", ["at least 1", "got 0"]),
        ("--size", "0", ["at least 1", "got 0"]),
        ("--model-width", "0", ["at least 1", "got 0"]),
        ("--device", "tpu", ["unknown device 'tpu'", "cpu"]),
        ("--device", "meta", ["'meta'", "cuda (cuda:N) or cpu"]),
    ],
)
def test_bench_checks_each_count_and_the_device(capsys, tmp_path, option, value, words):
    result = in_process(capsys, "bench", *SMALL_BENCH, "--out", str(tmp_path / "out"), option, value)
    assert_one_line_usage_error(*result, "bench", option, *words)
    assert not (tmp_path / "out").exists(), "no output folder for a run that never started"


@pytest.mark.skipif(CUDA, reason="a GPU is visible: the no-GPU answer cannot be seen here")
def test_bench_on_cuda_without_a_gpu_says_none_is_visible(capsys, tmp_path):
    result = in_process(capsys, "bench", *SMALL_BENCH, "--out", str(tmp_path), "--device", "cuda")
    assert_one_line_usage_error(*result, "bench", "--device", "no CUDA GPU is visible")


@pytest.mark.needs_cuda
def test_bench_on_a_gpu_this_machine_lacks_says_how_many_there_are(capsys, tmp_path):
    result = in_process(capsys, "bench", *SMALL_BENCH, "--out", str(tmp_path), "--device", "cuda:99")
    assert_one_line_usage_error(*result, "bench", "--device", "cuda:99", "CUDA GPU(s)")


@pytest.mark.parametrize(
    ("factory", "words"),
    [
        ("no_such_name", ["AttributeError", "no_such_name"]),
        ("raises", ["RuntimeError", "no data under /data/records set DATA_ROOT"]),  # two lines made one
        ("empty", ["empty data set"]),
        ("without_dataset", ["without 'dataset'", "'batch_size'"]),
        ("a_number", ["gave a int, not a Dataset"]),
        ("without_len", ["map-style NoLength without len()", "IterableDataset"]),
    ],
)
def test_bench_says_what_is_wrong_with_a_user_factory(capsys, tmp_path, factories, factory, words):
    result = in_process(capsys, "bench", "--dataset", f"{factories}:{factory}", "--out", str(tmp_path))
    assert_one_line_usage_error(*result, "bench", "--dataset", *words)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("nosuch", ["want module:factory", "got 'nosuch'"]),
        ("tests/no_such_file.py:make", ["no file tests/no_such_file.py"]),
    ],
)
def test_bench_says_what_is_wrong_with_the_spec_itself(capsys, tmp_path, spec, words):
    result = in_process(capsys, "bench", "--dataset", spec, "--out", str(tmp_path))
    assert_one_line_usage_error(*result, "bench", "--dataset", *words)


def test_bench_integrated_with_a_factory_without_a_step_says_what_to_add(capsys, tmp_path, factories):
    spec = f"{factories}:without_step"
    options = ["--dataset", spec, "--observation", "integrated", "--out", str(tmp_path)]
    result = in_process(capsys, "bench", *options)
    assert_one_line_usage_error(*result, "bench", "--observation", "gave no 'step'", "--observation loader")


def test_bench_and_profile_refuse_an_output_folder_that_is_a_file(capsys, tmp_path):
    a_file = tmp_path / "results"
    a_file.write_text("")
    for verb, extra in (("bench", ["--no-progress"]), ("profile", [])):
        result = in_process(capsys, verb, "--preset", "fields", "--size", "64", *extra, "--out", str(a_file))
        assert_one_line_usage_error(*result, verb, "--out", "is a file, not a folder")


def test_profile_checks_the_counts_it_shares_with_the_bench(capsys, tmp_path):
    result = in_process(capsys, "profile", "--preset", "fields", "--steps", "0", "--out", str(tmp_path))
    assert_one_line_usage_error(*result, "profile", "--steps", "got 0")


@pytest.mark.parametrize(
    ("options", "argument", "words"),
    [
        (["--batch-size", "0"], "--batch-size", ["at least 1", "got 0"]),
        (["--workers", "0"], "--workers", ["at least 1", "got 0"]),
        (["--timeout", "-1"], "--timeout", ["at least 0", "got -1.0"]),
        (["--json", "no_such_folder/report.json"], "--json", ["no folder no_such_folder"]),
        (["--json", "tests"], "--json", ["is a folder"]),
    ],
)
def test_doctor_checks_each_option_before_the_checklist_runs(capsys, options, argument, words):
    result = in_process(capsys, "doctor", "tests.helpers.audit_datasets:clean", *options)
    assert_one_line_usage_error(*result, "doctor", argument, *words)


def test_doctor_names_a_factory_that_raises_or_is_missing(capsys, factories):
    for factory, words in (("raises", ["RuntimeError", "DATA_ROOT"]), ("nosuch", ["AttributeError"])):
        result = in_process(capsys, "doctor", f"{factories}:{factory}")
        expected = [f"cannot load {factories}:{factory}", *words]
        assert_one_line_usage_error(*result, "doctor", "factory", *expected)


def test_debug_in_process_raises_the_usage_error_chained_to_its_cause(capsys, tmp_path):
    with pytest.raises(UsageError) as raised:
        dispatch(["--debug", "bench", "--dataset", "nosuch:thing", "--out", str(tmp_path)])
    assert raised.value.argument == "--dataset"
    assert isinstance(raised.value.__cause__, ModuleNotFoundError)


def test_a_good_command_line_still_runs(capsys, tmp_path):
    """The checks stop bad input only: the smallest valid doctor run goes through to its verdict."""
    status, out, err = in_process(capsys, "doctor", "tests.helpers.audit_datasets:clean", "--workers", "1")
    assert status == 0, err
    assert "Verdict: OK: workers=1 delivers the same samples" in out


# --- what a good run prints: every line fits a terminal, whichever verb --------------------------------

TERMINAL_WIDTH = 100


@pytest.mark.parametrize(
    ("verb", "options", "status", "opening", "closing"),
    [
        ("doctor", ["--dataset", "tests.helpers.audit_datasets:clean"], 0, "Records", "Verdict: OK"),
        # a failure adds the missing and duplicated ids, the worker that sent each, a longer verdict
        ("doctor", ["--dataset", "tests.helpers.audit_datasets:stale_cache"], 1, "StaleCacheInWorkers",
         "Verdict: FAIL"),
        ("profile", ["--dataset", "tests.helpers.bench_datasets:tiny", "--steps", "2", "--warmup", "1",
                     "--workers", "0"], 0, "tests.helpers.bench_datasets:tiny", "reminder: profiled"),
    ],
)
def test_every_line_of_a_run_on_a_users_data_set_fits_a_terminal(capsys, tmp_path, verb, options, status,
                                                                   opening, closing):
    """Only a word that cannot be broken (a path longer than the terminal) may stand wider, on its own."""
    extra = ["--batch-size", "4"] if verb == "doctor" else ["--out", str(tmp_path)]
    result, out, err = in_process(capsys, verb, *options, *extra)
    assert result == status, err
    assert opening in out.splitlines()[0], out  # the user's data set, as --dataset named it
    assert closing in out, out  # the whole run printed, to its last lines
    too_wide = [line for line in out.splitlines() if len(line) > TERMINAL_WIDTH and len(line.split()) > 1]
    assert not too_wide, "\n".join(too_wide)


# --- the pieces of fastcollate.tools.cli --------------------------------------------------------------------


def test_at_least_lets_the_default_and_the_minimum_through_and_stops_below_it():
    at_least("--steps", None, 1)
    at_least("--steps", 1, 1)
    with pytest.raises(UsageError, match=r"^--steps: must be at least 1 \(one\), got 0$"):
        at_least("--steps", 0, 1, " (one)")


def test_loading_passes_a_usage_error_through_and_wraps_anything_else():
    with pytest.raises(UsageError) as raised, loading("--dataset", "m:f"):
        raise KeyError("k")
    assert str(raised.value) == "--dataset: cannot load m:f: KeyError: 'k'"
    assert isinstance(raised.value.__cause__, KeyError)
    inner = UsageError("--dataset", "already said")
    with pytest.raises(UsageError) as raised, loading("--dataset", "m:f"):
        raise inner
    assert raised.value is inner


def test_output_folder_makes_missing_parents(tmp_path):
    path = tmp_path / "a" / "b"
    assert output_folder("--out", path) == path and path.is_dir()
    assert output_folder("--out", path) == path, "an existing folder is fine"
