"""Builds fastcollate._C: a CUDA extension when torch is a CUDA build and a toolkit is found, else CPU-only.

Every decision is printed, because a wrong guess (the wrong toolkit, no CUDA at all) otherwise only
shows up later as a missing symbol or a silently CPU-only build.

Switches (environment):
  FASTCOLLATE_CUDA=1 forces the CUDA build (fails if no toolkit), =0 forces CPU-only.
  CUDA_HOME / CUDA_PATH name the toolkit; otherwise it is found from nvcc on PATH.
  TORCH_CUDA_ARCH_LIST chooses GPU architectures; default 9.0 (Hopper) when no GPU is visible.
  FASTCOLLATE_DEBUG=1 builds with -O0 -g; FASTCOLLATE_SANITIZE=1 adds ASan and UBSan, =thread adds TSan.
"""

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

BUILD_COMMAND = "pip install -v --no-build-isolation ."  # -v: pip shows a build's output only with it


def say(message: str) -> None:
    print(f"[fastcollate build] {message}", flush=True)


def torch_outside_the_build_environment() -> bool:
    """Whether this interpreter finds torch once pip's isolated build environment is taken away: pip
    hides the interpreter's own site-packages behind PYTHONPATH and PYTHONNOUSERSITE."""
    hidden_by_pip = ("PYTHONPATH", "PYTHONNOUSERSITE")
    environment = {name: value for name, value in os.environ.items() if name not in hidden_by_pip}
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"
    flags = ["-S"] if sys.flags.no_site else []
    found = subprocess.run([sys.executable, *flags, "-c", probe], env=environment, capture_output=True)
    return found.returncode == 0


def stop_without_torch() -> None:
    """The extension compiles against the torch it will run with, so that torch must be installed first
    and visible to the build: an isolated build would fetch another torch (another version, CUDA or not)
    and build a core that fails to load beside the user's."""
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as error:
        if error.name != "torch":  # torch is there but broken: its own error says why
            raise
        if torch_outside_the_build_environment():
            sys.exit(
                "[fastcollate build] torch is installed, but pip's isolated build cannot see it, and "
                f"fastcollate compiles against the torch it runs with: build with `{BUILD_COMMAND}` "
                "(setuptools, wheel and ninja installed; -v shows the progress)"
            )
        sys.exit(
            "[fastcollate build] torch is not installed, and fastcollate compiles against the torch it runs "
            "with: install it first (`pip install torch setuptools wheel ninja`; a CUDA build of torch: "
            f"https://pytorch.org/get-started/locally/), then build beside it with `{BUILD_COMMAND}` (-v "
            "shows the progress)"
        )


stop_without_torch()


def _toolkit_root_from_nvcc(nvcc: str) -> str | None:
    """The toolkit folder holding this nvcc; follows links and wrapper scripts that exec another nvcc."""
    real = os.path.realpath(nvcc)
    candidates = [os.path.dirname(os.path.dirname(real))]
    try:
        with open(real, "rb") as handle:
            head = handle.read(4096)
        if head.startswith(b"#!"):  # a wrapper script: find the nvcc it runs
            for match in re.finditer(rb"(/[^\s\"']+/bin/nvcc)\b", head):
                target = os.path.realpath(match.group(1).decode())
                candidates.insert(0, os.path.dirname(os.path.dirname(target)))
    except OSError:
        pass
    for root in candidates:
        if _is_toolkit(root):
            return root
    return None


def _is_toolkit(root: str) -> bool:
    return os.path.isfile(os.path.join(root, "bin", "nvcc")) and os.path.isfile(
        os.path.join(root, "include", "cuda_runtime.h")
    )


def find_cuda_home() -> str | None:
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(variable)
        if value:
            say(f"CUDA toolkit from ${variable}: {value}")
            return value
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = _toolkit_root_from_nvcc(nvcc)
        if root:
            say(f"CUDA toolkit found from nvcc on PATH ({nvcc}): {root}")
            return root
        say(f"nvcc on PATH ({nvcc}) does not lead to a toolkit with include/cuda_runtime.h")
    for root in ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]:
        if _is_toolkit(root):
            say(f"CUDA toolkit found at the usual place: {root}")
            return root
    say("no CUDA toolkit found")
    return None


# torch.utils.cpp_extension reads CUDA_HOME once, at import: decide it before importing.
CUDA_SWITCH = os.environ.get("FASTCOLLATE_CUDA", "auto")
CUDA_HOME = None if CUDA_SWITCH == "0" else find_cuda_home()
if CUDA_HOME:
    os.environ["CUDA_HOME"] = CUDA_HOME

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

say(f"python {sys.version.split()[0]}, torch {torch.__version__}, torch.version.cuda = {torch.version.cuda}")
say(f"FASTCOLLATE_CUDA = {CUDA_SWITCH!r}")

if CUDA_SWITCH == "0":
    USE_CUDA = False
    say("CUDA build: off (FASTCOLLATE_CUDA=0)")
elif torch.version.cuda is None:
    USE_CUDA = False
    say("CUDA build: off (this torch is a CPU-only build)")
elif CUDA_HOME is None:
    USE_CUDA = False
    say("CUDA build: off (torch is a CUDA build but no toolkit was found; set CUDA_HOME)")
else:
    USE_CUDA = True
    say(f"CUDA build: on, toolkit {CUDA_HOME}")
if CUDA_SWITCH == "1" and not USE_CUDA:
    sys.exit("[fastcollate build] FASTCOLLATE_CUDA=1 but a CUDA build is not possible (see above)")

if USE_CUDA and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
    visible = False
    try:
        visible = torch.cuda.is_available()
    except Exception:  # no driver: same as no GPU
        visible = False
    if visible:
        say("TORCH_CUDA_ARCH_LIST unset; a GPU is visible, so torch builds for it")
    else:
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
        say("TORCH_CUDA_ARCH_LIST unset and no GPU visible: building for 9.0 (Hopper)")
elif USE_CUDA:
    say(f"TORCH_CUDA_ARCH_LIST = {os.environ['TORCH_CUDA_ARCH_LIST']} (from the environment)")

debug = os.environ.get("FASTCOLLATE_DEBUG") == "1"
# "1": AddressSanitizer and UndefinedBehaviorSanitizer; "thread": ThreadSanitizer (it cannot be combined
# with ASan).
sanitizers = {"1": "address,undefined", "thread": "thread"}.get(os.environ.get("FASTCOLLATE_SANITIZE", ""))
sanitize = sanitizers is not None
# A release build carries no debug info: Python's own CFLAGS add -g, which doubles the compile time of
# every file (they all parse torch's headers: 45 s against 23 s for the smallest) and the .so's size.
# FASTCOLLATE_DEBUG=1 builds with it.
cxx_flags = ["-O0", "-g"] if debug or sanitize else ["-O3", "-g0"]
cxx_flags += ["-fdiagnostics-color=never", "-fvisibility=hidden"]  # C++ standard: torch's choice
# at::parallel_for is header code over `#pragma omp parallel`: without -fopenmp our copies run on one
# thread whatever torch.set_num_threads says. libgomp.so.1 is the one torch itself loads.
cxx_flags += ["-fopenmp"]
link_flags = ["-fopenmp"]
if sanitize:
    cxx_flags += [f"-fsanitize={sanitizers}", "-fno-omit-frame-pointer"]
    link_flags += [f"-fsanitize={sanitizers}"]
say(
    f"optimisation: {'debug (-O0 -g)' if debug or sanitize else 'release (-O3, no debug info)'}; "
    f"sanitizers: {sanitizers or 'none'}"
)


# csrc/ by concern (collate/, fill/, memory/, ops/): every .cpp, but those in a cuda/ folder
# (ops/cuda/, memory/cuda/) and the .cu files only in a CUDA build: only they include CUDA headers.
def in_cuda_folder(path: str) -> bool:
    return "cuda" in path.split("/")[1:-1]


cpp_sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
sources = [path for path in cpp_sources if not in_cuda_folder(path)]
define_macros = []
include_dirs = [os.path.abspath("csrc")]
extra = {"cxx": cxx_flags}
if USE_CUDA:
    sources += sorted(glob.glob("csrc/**/*.cu", recursive=True))
    sources += [path for path in cpp_sources if in_cuda_folder(path)]
    define_macros.append(("FASTCOLLATE_WITH_CUDA", None))
    extra["nvcc"] = ["-O3", "-lineinfo"] + (["-g", "-G"] if debug else [])
    extension_class = CUDAExtension
else:
    extension_class = CppExtension
say(f"sources: {' '.join(sources)}")


class BuildWithProgress(BuildExtension):
    """torch's BuildExtension, saying what the compiling takes before it starts (only when it builds, not
    each time setup.py runs)."""

    def build_extensions(self) -> None:
        say(f"compiling what changed of {len(sources)} files (all of them: minutes on a few cores); ninja "
            "prints an [n/N] line as each one is done")
        super().build_extensions()


setup(
    ext_modules=[
        extension_class(
            "fastcollate._C",
            sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args=extra,
            extra_link_args=link_flags,
        )
    ],
    cmdclass={"build_ext": BuildWithProgress.with_options(use_ninja=True)},
)
