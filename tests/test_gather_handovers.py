"""HANDED_TO_THE_WALK is tied to the code: every place where the column gather (gather.py, ColumnGather in
C++) or ArrowGather hands a batch to the per-sample walk names its case, through ``_handed_over`` in
Python or ``handed_to_the_walk`` in C++, and the cases named are exactly the list's keys. A hand-over
that returns None bare, or names a case the list lacks, fails here until it is listed with its reason."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from fastcollate.collate.gather import HANDED_TO_THE_WALK

ROOT = Path(__file__).resolve().parent.parent
GATHER_PY = ROOT / "fastcollate" / "collate" / "gather.py"
COLUMN_GATHER_CPP = ROOT / "csrc" / "collate" / "column_gather.cpp"
ARROW_GATHER_CPP = ROOT / "csrc" / "collate" / "arrow_gather.cpp"
CPP_SOURCES = sorted((ROOT / "csrc").rglob("*.cpp")) + sorted((ROOT / "csrc").rglob("*.h"))

NAMED_IN_CPP = re.compile(r'\bhanded_to_the_walk\(\s*"((?:[^"\\]|\\.)*)"\s*\)')


def python_cases(source: str) -> tuple[set[str], list[int]]:
    """The cases ``source`` names through ``_handed_over``, and the lines of its bare ``return None``s:
    those of a function other than ``_handed_over``, where None is not a helper's None passed on (``if x is
    None: return None``)."""
    tree = ast.parse(source)
    cases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_handed_over":
            assert len(node.args) == 1 and isinstance(node.args[0], ast.Constant), (
                f"line {node.lineno}: _handed_over takes its case as a string literal"
            )
            cases.add(node.args[0].value)
    passed_on = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.ops[0], ast.Is)
            and isinstance(node.test.comparators[0], ast.Constant)
            and node.test.comparators[0].value is None
        ):
            passed_on.update(id(statement) for statement in node.body if isinstance(statement, ast.Return))
    bare = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef) or function.name == "_handed_over":
            continue
        for node in ast.walk(function):
            returns_none = isinstance(node, ast.Return) and (
                node.value is None or (isinstance(node.value, ast.Constant) and node.value.value is None)
            )
            if returns_none and id(node) not in passed_on:
                bare.append(node.lineno)
    return cases, bare


def cpp_function(source: str, name: str) -> str:
    """The definition of the function ``name`` (qualified as written there) in ``source``: from its line,
    which starts at column 0, to its closing brace, also at column 0."""
    start = re.search(rf"^\S.*\b{re.escape(name)}\(", source, re.M)
    assert start is not None, f"no definition of {name}"
    return source[start.start():source.index("\n}\n", start.start())]


def cpp_bare_handovers(source: str) -> list[str]:
    """The hand-overs of the column gather's and ArrowGather's plans that name no case: a bare None from
    the plan of a batch or of a table, or a null node from a node builder (the plan hands the batch over
    for it)."""
    bare = []
    for name in ("ColumnGather::plan_rows", "ArrowGather::plan"):
        if re.search(rf"^\S.*\b{re.escape(name)}\(", source, re.M):
            bare += [f"{name}: {line.strip()}" for line in cpp_function(source, name).splitlines()
                     if "return py::none()" in line]
    for name in re.findall(r"^std::unique_ptr<Node> (\w+_node)\(", source, re.M):
        bare += [f"{name}: {line.strip()}" for line in cpp_function(source, name).splitlines()
                 if "return nullptr" in line]
    return bare


def test_the_cases_named_where_batches_are_handed_over_are_the_lists_keys():
    named_in_python, _ = python_cases(GATHER_PY.read_text())
    named_in_cpp = {case for path in CPP_SOURCES for case in NAMED_IN_CPP.findall(path.read_text())}
    named = named_in_python | named_in_cpp
    assert named - HANDED_TO_THE_WALK.keys() == set(), "handed over for a case HANDED_TO_THE_WALK lacks"
    assert HANDED_TO_THE_WALK.keys() - named == set(), "listed in HANDED_TO_THE_WALK, handed over nowhere"
    assert all(reason.strip() for reason in HANDED_TO_THE_WALK.values())


def test_the_plans_hand_batches_over_in_both_languages():
    named_in_python, _ = python_cases(GATHER_PY.read_text())
    assert "a shared mask" in named_in_python
    named_in_column_gather = NAMED_IN_CPP.findall(COLUMN_GATHER_CPP.read_text())
    assert "ragged rows of unequal length without a pad" in named_in_column_gather
    assert "an empty table" in NAMED_IN_CPP.findall(ARROW_GATHER_CPP.read_text())


def test_no_hand_over_returns_none_bare():
    _, bare = python_cases(GATHER_PY.read_text())
    assert bare == [], f"gather.py: a bare return None at lines {bare}: return _handed_over(case)"
    for path in (COLUMN_GATHER_CPP, ARROW_GATHER_CPP):
        assert cpp_bare_handovers(path.read_text()) == [], path.name


def test_the_checks_catch_a_hand_over_left_unnamed():
    planted = (
        "def _handed_over(reason):\n    return None\n\n"
        "def chooser(column):\n"
        "    found = pick(column)\n"
        "    if found is None:\n        return None\n"
        "    if column.odd:\n        return None\n"
        "    if column.even:\n        return _handed_over('an even column')\n"
        "    return found\n"
    )
    cases, bare = python_cases(planted)
    assert cases == {"an even column"}
    assert bare == [9]
    planted_cpp = (
        "std::unique_ptr<Node> odd_node(BatchLayout& layout) {\n  if (odd) {\n    return nullptr;\n  }\n"
        "  return layout.handed_to_the_walk(\"an odd node\");\n}\n\n"
        "py::object ColumnGather::plan_rows(const at::Tensor& indices, bool in_order) const {\n"
        "  if (empty) {\n    return py::none();\n  }\n  return plan;\n}\n"
    )
    assert NAMED_IN_CPP.findall(planted_cpp) == ["an odd node"]
    assert cpp_bare_handovers(planted_cpp) == [
        "ColumnGather::plan_rows: return py::none();", "odd_node: return nullptr;"
    ]
