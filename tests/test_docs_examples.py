"""Every code block of README.md and docs/*.md is checked, so that none goes stale unseen.

- A ``python`` block runs as written, in a fresh interpreter at the repository's root, and what it prints
  is checked (``RUN``). A block that needs what a test machine lacks (a model, a tokenizer, DDP processes
  under Lightning) is ``COMPILE_ONLY``, with the reason and the test that covers what it shows: it
  compiles, every name it uses is defined or imported in it, and its imports and the attributes it reads
  from them exist.
- A ``sh`` block's commands name make targets, files and command-line options that exist.
- A block without a language is output, listed in ``OUTPUT`` with the test that compares it with what
  the code prints.
- An indented code block would be seen by no test: there is none.

Each block is found by a marker, a piece of its text found in no other block of its file. A block that
no list names fails ``test_every_block_has_a_check``: a new block needs a check here.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import re
import shlex
import subprocess
import symtable
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.processes import run_side_by_side

markdown_it = pytest.importorskip("markdown_it", reason="markdown-it-py is not installed")

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md"))]


def blocks(page: str) -> list[tuple[str, str]]:
    """The page's code blocks as (language, text); an indented block's language is "indented"."""
    tokens = markdown_it.MarkdownIt("commonmark").parse((ROOT / page).read_text())
    return [(token.info.strip() if token.type == "fence" else "indented", token.content)
            for token in tokens if token.type in ("fence", "code_block")]


def block(page: str, marker: str) -> str:
    (found,) = [text for _, text in blocks(page) if marker in text] or [None]
    assert found is not None, f"{page}: no block holds {marker!r}"
    return found


# What each block that runs must print.


def readme_usage(lines: list[str]) -> None:
    assert len(lines) == 4 and all(line.startswith("torch.float32 (256, 3, 64, 64)") for line in lines), lines
    assert lines[1].endswith("[256, 257, 258]")  # ids name the rows, in order


def arrays_batches(lines: list[str]) -> None:
    assert lines == ["(256, 3, 32, 32) torch.int64"] * 3 + ["(232, 3, 32, 32) torch.int64"], lines


def hf_sample_is_its_row(lines: list[str]) -> None:
    (line,) = lines  # the sample's two keys read the row's one column, as int64 (Hugging Face's collators')
    match = re.fullmatch(r"\{'input_ids': tensor\((\[[\d, ]+\])\), "
                         r"'labels': tensor\((\[[\d, ]+\])\)\} (\[[\d, ]+\])", line)
    assert match and match.group(1) == match.group(2) == match.group(3), line


def every_index_once(lines: list[str]) -> None:
    assert lines == ["1000 1000"], lines


def packed_keys(lines: list[str]) -> None:
    keys = ["cu_seq_lens_k", "cu_seq_lens_q", "id", "input_ids", "labels", "max_length_k", "max_length_q",
            "position_ids", "seq_idx"]
    assert lines == [str(keys)], lines


def token_budget_delivers_every_sample(lines: list[str]) -> None:
    assert lines == ["1000 samples"], lines


def labels_copied_from_input_ids(lines: list[str]) -> None:
    rows = [[1, 2, 3][: 1 + i % 3] for i in range(8)]
    tokens = [t for row in rows for t in row]
    labels = [t if position else -100 for row in rows for position, t in enumerate(row)]
    keys = ["cu_seq_lens_k", "cu_seq_lens_q", "input_ids", "labels", "max_length_k", "max_length_q",
            "position_ids"]  # no attention_mask
    assert lines == [f"{[tokens]} {[labels]} {keys}"], lines


def left_padded_to_eight(lines: list[str]) -> None:
    assert lines == [
        "[[0, 0, 0, 0, 0, 101, 7, 102], [0, 0, 0, 0, 0, 0, 101, 102]]",
        "[[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]]",
    ], lines


def walk_and_gather_agree(lines: list[str]) -> None:
    assert lines == [
        "[[1, 2, 3], [4, 0, 0]] [[True, True, True], [True, False, False]] [3, 1]",
        "['id', 'x', 'x_lengths', 'x_mask'] True",  # the gathered batch is the walked one
        "ContractTypeError 7 x",
    ], lines


def worker_epoch_audited(lines: list[str]) -> None:
    assert lines[:2] == ["delivered against reference: OK",
                         "  delivered 100 samples; reference has 100 ids"], lines  # every id once


def resumed_every_sample_once(lines: list[str]) -> None:
    assert lines == ["True", "True"], lines


def pipeline_batches(lines: list[str]) -> None:
    assert len(lines) == 4 and all(line.startswith("torch.Size([256, 3, 64, 64])") for line in lines), lines


RUN: dict[tuple[str, str], Callable[[list[str]], None]] = {
    ("README.md", "class Images(Dataset)"): readme_usage,
    ("docs/usage.md", "fastcollate.Arrays(image=images_u8"): arrays_batches,
    ("docs/usage.md", 'padding_side="left",'): left_padded_to_eight,
    ("docs/usage.md", "Arrays.from_hf(train"): hf_sample_is_its_row,
    ("docs/usage.md", "IndexBatches(len(dataset)"): every_index_once,
    ("docs/usage.md", "# + return_seq_idx=True"): packed_keys,
    ("docs/usage.md", "TokenBudgetBatches(lengths"): token_budget_delivers_every_sample,
    ("docs/usage.md", 'copy_of="input_ids"'): labels_copied_from_input_ids,
    ("docs/how-it-works.md", "rows.__getitems__([0, 1])"): walk_and_gather_agree,
    ("docs/integrations.md", "PipelineBuilder"): pipeline_batches,
    ("docs/integrations.md", "fastcollate.sampler_state(checkpoint"): resumed_every_sample_once,
    ("docs/integrations.md", "nodes.ParallelMapper"): pipeline_batches,
    ("docs/measuring.md", "ledger.watch(DataLoader"): worker_epoch_audited,
}

COMPILE_ONLY: dict[tuple[str, str], str] = {
    ("docs/integrations.md", "callbacks=[ExactResume()]"):
        "needs a data set, checkpoints and DDP processes on 1 to 3 devices: tests/test_elastic_resume.py "
        "stops and resumes the same set-up under torchrun, 2 -> 1, 1 -> 2, 2 -> 3 and 3 -> 2 ranks",
    ("docs/integrations.md", "DeviceLoaderCallback(depth=2)"):
        "needs a LightningModule and two DDP processes: tests/test_lightning.py runs "
        "examples/lightning_train.py, the same set-up, on two CPU ranks",
    ("docs/integrations.md", "DataCollatorWithPadding(tokenizer)"):
        "needs a tokenizer, which is a download: tests/test_hf_batches.py checks such a contract's batch "
        "against DataCollatorWithPadding's with a tokenizer built offline",
    ("docs/integrations.md", "shard.iter_torch_batches(batch_size=16"):
        "needs a Ray cluster and Ray Train's workers: tests/test_ray.py trains a tiny Llama on two gloo "
        "workers with such a contract and compares its losses with DataCollatorWithFlattening's",
    ("docs/integrations.md", "train_dataset=Arrays.from_hf"):
        "needs a causal LM and a tokenized dataset: tests/test_trainer.py trains a tiny Llama on this "
        "contract and compares its losses with Hugging Face's own collator's",
}

OUTPUT: dict[tuple[str, str], str] = {
    ("README.md", "ContractSizeError: sample id=103"):
        "tests/test_readme.py::test_the_error_the_usage_shows_is_the_one_its_contract_gives",
    ("docs/measuring.md", "resume check: 8 checkpoints"):
        "tests/test_doctor_resume.py::test_the_resume_check_the_docs_show_is_what_the_command_prints",
    ("docs/integrations.md", "2 ranks together against the dataset: OK"):
        "tests/test_examples.py::test_the_ddp_example_delivers_every_id_once_per_epoch_across_two_gloo_ranks",
}


def test_every_block_has_a_check():
    listed = {"python": [*RUN, *COMPILE_ONLY], "": list(OUTPUT)}
    for page in PAGES:
        for language, text in blocks(page):
            indented = f"{page}: an indented code block; fence it, with its language:\n{text}"
            assert language != "indented", indented
            if language == "sh":
                continue  # every sh block is checked below
            assert language in listed, f"{page}: a {language!r} block, which no test here checks:\n{text}"
            names = [marker for where, marker in listed[language] if where == page and marker in text]
            assert len(names) == 1, f"{page}: a {language} block that {len(names)} markers name:\n{text}"
    for where, marker in [*RUN, *COMPILE_ONLY, *OUTPUT]:
        block(where, marker)  # each marker names exactly one block


@pytest.fixture(scope="module")
def ran() -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """Every RUN block, each in a fresh interpreter at the repository's root, all side by side."""
    return run_side_by_side({where: [sys.executable, "-c", block(*where)] for where in RUN}, cwd=ROOT)


@pytest.mark.parametrize("where", list(RUN), ids=lambda where: f"{where[0]}:{where[1]}")
def test_the_block_runs_as_written(where, ran):
    done = ran[where]
    assert done.returncode == 0, done.stderr[-3000:]
    RUN[where](done.stdout.splitlines())


def undefined_names(code: str) -> set[str]:
    """The names a block reads that nothing in it binds (builtins aside), in any of its scopes."""
    top = symtable.symtable(code, "<block>", "exec")
    bound = {s.get_name() for s in top.get_symbols()
             if s.is_assigned() or s.is_imported() or s.is_namespace()}
    read: set[str] = set()

    def walk(table: symtable.SymbolTable) -> None:
        read.update(s.get_name() for s in table.get_symbols()
                    if s.is_referenced() and (table is top or s.is_global()))
        for child in table.get_children():
            walk(child)

    walk(top)
    return read - bound - set(dir(builtins))


def test_undefined_names_finds_a_name_read_in_any_scope():
    assert undefined_names("import torch\nx = torch.zeros(1)\n") == set()
    assert undefined_names("x = [y for _ in range(2)]\n") == {"y"}
    assert undefined_names("def f():\n    return model\n") == {"model"}


@pytest.mark.parametrize("where", list(COMPILE_ONLY), ids=lambda where: f"{where[0]}:{where[1]}")
def test_the_block_compiles_and_defines_every_name_it_uses(where):
    code = block(*where)
    for path in re.findall(r"tests/\w+\.py", COMPILE_ONLY[where]):
        assert (ROOT / path).is_file(), f"the reason names {path}, which does not exist"
    tree = ast.parse(code)
    assert not undefined_names(code), f"used, never defined or imported: {sorted(undefined_names(code))}"
    modules: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                modules[alias.asname or alias.name.split(".")[0]] = imported(alias.name.split(".")[0])
                imported(alias.name)
        elif isinstance(node, ast.ImportFrom):
            source = imported(node.module)
            for alias in node.names:
                assert hasattr(source, alias.name), f"{node.module} has no {alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            assert hasattr(modules[node.value.id], node.attr), f"{node.value.id} has no {node.attr}"


def imported(name: str) -> object:
    """The module, or the test skipped when it is a third-party package this environment lacks."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as missing:
        if missing.name.split(".")[0] == "fastcollate":
            raise
        pytest.skip(f"{missing.name} is not installed")


@pytest.mark.parametrize("where", list(OUTPUT), ids=lambda where: f"{where[0]}:{where[1]}")
def test_an_output_block_is_compared_by_its_test(where):
    path, name = OUTPUT[where].split("::")
    test = (ROOT / path).read_text()
    assert f"def {name}(" in test, f"{OUTPUT[where]} does not exist"


# sh blocks: what each command names must exist.

MAKE_TARGETS = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


@functools.cache
def help_text(*command: str) -> str:
    done = subprocess.run([sys.executable, *command, "--help"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def options_exist(command: tuple[str, ...], line: str) -> None:
    """Every --option of the line, and every choice it lists as a|b|c, is in the command's --help."""
    shown = help_text(*command)
    for option in re.findall(r"(?<![\w-])--[a-z][\w-]*", line):
        assert re.search(rf"{option}\b", shown), f"{' '.join(command)} has no {option}: {line}"
    for option, choices in re.findall(r"(--[a-z][\w-]*) ([a-z]+(?:\|[a-z]+)+)", line):
        taken = re.search(rf"{option} \{{([\w,-]+)\}}", shown)
        assert taken, f"{' '.join(command)} {option} lists no choices: {line}"
        for choice in choices.split("|"):
            assert choice in taken.group(1).split(","), f"{' '.join(command)} {option} does not take {choice}"


def extras() -> set[str]:
    found = re.search(r"^\[project\.optional-dependencies\]\n(.*?)^\[", (ROOT / "pyproject.toml").read_text(),
                      re.M | re.S)
    return set(re.findall(r"^([a-z][\w-]*) = ", found.group(1), re.M))


def check_command(line: str) -> None:
    words = shlex.split(line)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words.pop(0)  # an environment variable set for the command
    program, args = words[0], words[1:]
    if program == "pip" and args[0] == "install":
        for arg in args[1:]:
            named = re.fullmatch(r"(?:\.|fastcollate)\[([\w,-]+)\]", arg)  # ".[hf]", "fastcollate[ray]"
            assert not named or set(named.group(1).split(",")) <= extras(), f"no such extra: {line}"
    elif program in (".", "source") or (program in ("python", "python3") and args[:2] == ["-m", "venv"]):
        pass  # making and entering a venv
    elif program == "make":
        for target in (arg for arg in args if "=" not in arg):
            assert target in MAKE_TARGETS, f"the Makefile has no target {target}: {line}"
    elif program in ("python", "python3") and args[:2] == ["-m", "fastcollate"]:
        options_exist(("-m", "fastcollate", args[2]), line)
    elif program in ("python", "python3") and args[0].endswith(".py"):
        assert (ROOT / args[0]).is_file(), f"no {args[0]}: {line}"
        if "--" in line:
            options_exist((args[0],), line)
    elif program == "torchrun":
        (script,) = [arg for arg in args if arg.endswith(".py")]
        assert (ROOT / script).is_file(), f"no {script}: {line}"
    elif program.endswith(".sh"):
        assert (ROOT / program).is_file(), f"no {program}: {line}"
    else:
        raise AssertionError(f"no check for the command {line!r}: add one to tests/test_docs_examples.py")


def test_a_pip_line_naming_an_extra_pyproject_lacks_fails():
    check_command('pip install -v --no-build-isolation ".[hf,resume]"')
    check_command('pip install "fastcollate[all]"')
    for line in ('pip install -v --no-build-isolation ".[hf,nope]"', 'pip install "fastcollate[nope]"'):
        with pytest.raises(AssertionError, match="no such extra"):
            check_command(line)


def shell_blocks() -> list[tuple[str, str]]:
    return [(page, text) for page in PAGES for language, text in blocks(page) if language == "sh"]


@pytest.mark.parametrize("page, text", shell_blocks(), ids=lambda value: value.split("\n")[0][:40])
def test_the_commands_of_a_shell_block_name_what_exists(page, text):
    lines = [line.split(" #", 1)[0] for line in text.replace("\\\n", " ").splitlines()]
    commands = [command.strip() for line in lines for command in line.split("&&")]
    commands = [command for command in commands if command and not command.startswith("#")]
    assert commands, f"{page}: a sh block without a command"
    for command in commands:
        check_command(command)


def test_every_test_file_and_make_target_the_pages_name_exists():
    for page in PAGES:
        text = (ROOT / page).read_text()
        for path in re.findall(r"\btests/\w+\.py", text):
            assert (ROOT / path).is_file(), f"{page} names {path}, which does not exist"
        for target in re.findall(r"`(?:[A-Z_]+=\S+ )*make ([a-z][\w-]*)", text):
            assert target in MAKE_TARGETS, f"{page} names `make {target}`, which the Makefile lacks"
