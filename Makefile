# Two entry points do all set-up on a fresh clone: `make demo` and `make test`.
# PYTHON=/path/to/python uses that interpreter as it is (no venv, no downloads): the GPU machine's way.
SHELL := /bin/bash
.DEFAULT_GOAL := help

ifdef PYTHON
PY := $(PYTHON)
DEPS := .stamp-deps-external
EXTRAS :=
else
PY := .venv/bin/python
DEPS := .venv/.stamp-deps
EXTRAS := .venv/.stamp-extras
endif

# Every C++ and CUDA file under csrc/, at any depth (collate/, fill/, memory/, ops/cpu/, ops/cuda/, memory/cuda/): a change
# to any of them rebuilds, and make lint checks them all.
CSRC := $(shell find csrc -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' \) | sort)
SOURCES := $(CSRC) setup.py pyproject.toml

help:
	@echo "make demo      build, then workers on pre-decoded images (slots on/off), the PIL-bound bench, arrays,"
	@echo "               Hugging Face datasets (DataCollatorWithFlattening, with_format(\"torch\"))"
	@echo "make test      build, then the test suite"
	@echo "make bench     pytest-benchmark suites (default_collate vs fastcollate); COMPARE=1 compares with the last run"
	@echo "make profile   python -m fastcollate profile: trace and timeline of wait, copy and compute"
	@echo "make fuzz      the long runs: 10,000 hypothesis examples a property, 20-epoch lifetimes, and the"
	@echo "               heavier variants of checks make test runs lighter (the tests marked fuzz)"
	@echo "make sanitize  build with ASan+UBSan and run the CPU tests under them (SANITIZER=thread: TSan, the"
	@echo "               thread tests)"
	@echo "make lint      ruff and clang-format, checked (needs both installed)"
	@echo "make build     only build the extension"
	@echo "make test-compat PYTHON=/path/to/python   the suite on a second interpreter and torch (not in CI)"

# Before the build: torch and the build's tools (requirements.txt). After it: everything else the tests and
# the demo need, which is the package's own `test` extra (pyproject.toml, the one list): pip reads it from the
# installed package's metadata and installs only what is missing.
.venv/.stamp-deps: requirements.txt
	test -x .venv/bin/python || python3 -m venv .venv
	.venv/bin/python -m pip install --quiet -r requirements.txt
	touch $@

.venv/.stamp-extras: .stamp-build pyproject.toml
	.venv/bin/python -m pip install --quiet "fastcollate[test]"
	touch $@

.stamp-deps-external:
	$(PY) -c "import torch, numpy, pytest; print('using', torch.__version__, 'at', torch.__file__)"
	touch $@

# pip shows a build's own output only with -v: the whole log goes to .stamp-build.log, and what it does is
# shown as it goes (scripts/build_progress.py): the build's decisions (toolkit, architectures, CPU-only or
# CUDA), once each, then a line per compiled file; a build that printed no decision fails.
.stamp-build: $(DEPS) $(SOURCES)
	@echo "building fastcollate._C, a few minutes (the whole log: .stamp-build.log)"
	@set -o pipefail; $(PY) -m pip install -v --no-build-isolation --no-deps -e . 2>&1 | tee .stamp-build.log \
		| $(PY) scripts/build_progress.py \
		|| { tail -n 60 .stamp-build.log; echo "the build failed: the whole log is .stamp-build.log"; exit 1; }
	@grep -q "\[fastcollate build\]" .stamp-build.log \
		|| { echo "the build printed none of its decisions: see .stamp-build.log"; exit 1; }
	$(PY) -c "import fastcollate" || (tail -n 60 .stamp-build.log; exit 1)
	touch $@

build: .stamp-build

test: .stamp-build $(EXTRAS)
	$(PY) -m pytest tests -q --durations=15

# First where the data path matters: pre-decoded images with workers (bound by moving bytes: shared slots
# on and off against default_collate), with a chart; then the FashionMNIST-like bench, bound by its PIL
# transforms, where no collate can show a gain; then data already in arrays, gathered by index; then
# Hugging Face datasets as loaded from disk, through HF's own collate and format against fastcollate's.
# The PIL-bound part at 0 and 2 workers, 5 interleaved runs each (the ~ mark's default): under 3 minutes on
# 2 cores, the worker part included. BENCH_ARGS adds options (--quick: 4 steps a run); BENCH_WORKERS= runs
# the bench's default worker counts.
BENCH_WORKERS ?= --workers 0 2
# With --quick the worker part runs 3 rounds (its verdict still needs the lead in every one): under a minute.
WORKER_ROUNDS := $(if $(findstring --quick,$(BENCH_ARGS)),3,5)
# The arrays part: 1M tabular rows and 100M tokens (a 200 MB file in the temporary folder, made once);
# with --quick a fifth of each and 3 rounds.
ARRAY_ARGS := $(if $(findstring --quick,$(BENCH_ARGS)),--rounds 3 --rows 200000 --tokens 20000000,--rounds 5)
# The Hugging Face part always runs --quick (a tenth of its rows, 3 rounds: 2-3 minutes on 2 cores);
# benchmarks/hf_ratios.py alone runs the full sizes, in up to 15.
demo: .stamp-build $(EXTRAS)
	@echo; echo "1/4  pre-decoded images through DataLoader workers: shared slots on and off, default_collate"
	$(PY) -m benchmarks.worker_ratios --datasets predecoded --rounds $(WORKER_ROUNDS) \
		--json bench-out-workers/results.json --chart bench-out-workers/chart.png
	@echo; echo "2/4  FashionMNIST-like images, bound by their PIL transforms (about 300 us a sample)"
	$(PY) -m fastcollate bench $(BENCH_WORKERS) $(BENCH_ARGS) --out bench-out-loader
	@echo; echo "3/4  data already in arrays: fastcollate.Arrays gathered by index, against the idiom and nanoGPT"
	$(PY) -m benchmarks.array_ratios --cases tabular tokens $(ARRAY_ARGS) --no-targets \
		--json bench-out-arrays/results.json
	@echo; echo "4/4  Hugging Face datasets from disk: HF's own collate and format, assemble, Arrays.from_hf;"
	@echo "     --quick: a tenth of the rows of the README's table, whose run is python -m benchmarks.hf_ratios"
	$(PY) -m benchmarks.hf_ratios --quick --json bench-out-hf/results.json
	@echo
	@$(PY) -m benchmarks.demo_summary bench-out-workers bench-out-loader bench-out-arrays bench-out-hf

bench: .stamp-build $(EXTRAS)
	$(PY) -m pytest benchmarks -q --benchmark-group-by=group --benchmark-columns=min,median,iqr,ops \
		--benchmark-autosave $(if $(COMPARE),--benchmark-compare)

profile: .stamp-build $(EXTRAS)
	$(PY) -m fastcollate profile $(PROFILE_ARGS)

# Hypothesis's statistics say how many examples each property ran (its event lines are left out). Then
# the tests marked fuzz: more seeds, repeats, start methods of checks make test runs fewer of.
fuzz: .stamp-build $(EXTRAS)
	set -o pipefail; FASTCOLLATE_FUZZ_EXAMPLES=10000 FASTCOLLATE_EPOCHS=20 $(PY) -m pytest tests/test_fuzz.py \
		tests/test_arrays.py tests/test_packed_arrays.py \
		tests/test_lifetimes.py -q --hypothesis-show-statistics | grep -vE '^ +(\* |- Events:)'
	FASTCOLLATE_FUZZ=1 $(PY) -m pytest tests -q -m fuzz

sanitize: $(DEPS) $(EXTRAS)
	PYTHON=$(PY) bash scripts/sanitize.sh

# Style checks (not part of make test: the tools are not among the dependencies). ruff and clang-format
# from PATH, or from the venv after `.venv/bin/pip install ruff clang-format`.
lint:
	@PATH="$(CURDIR)/.venv/bin:$$PATH"; command -v ruff >/dev/null && command -v clang-format >/dev/null \
		|| { echo "make lint needs ruff and clang-format: pip install ruff clang-format"; exit 2; }; \
		ruff check . && clang-format --dry-run -Werror $(CSRC) \
		&& echo "ruff and clang-format: clean"

# Another interpreter with its own torch already installed (e.g. torch 2.11 on Python 3.12, as on the GPU
# machine): built in place beside the main build (its own .so suffix and build folder), then the suite.
test-compat:
	@test -n "$(PYTHON)" || { echo "make test-compat needs PYTHON=/path/to/python (with torch installed)"; exit 2; }
	$(PYTHON) -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
	set -o pipefail; $(PYTHON) -m pip install -v --no-build-isolation --no-deps -e . 2>&1 | tee .compat-build.log \
		| grep "\[fastcollate build\]"
	$(PYTHON) -m pytest tests -q -p no:cacheprovider

clean:
	rm -rf build *.egg-info fastcollate/_C*.so .stamp-* .venv/.stamp-deps .venv/.stamp-extras

.PHONY: help build test test-compat demo bench profile fuzz sanitize lint clean
