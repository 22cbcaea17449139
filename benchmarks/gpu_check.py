"""`make gpu-check`: the CUDA-touching tests and the GPU benchmarks in one call, within 5 minutes.

The GPU machine this project is checked on (one H100 or H200, Python 3.12) has torch,
transformers, lightning, matplotlib, pytest and pytest-xdist, but no IPython, ipywidgets or
nbval, and no internet. So:

    make gpu-wheels   (here, online)  python -m benchmarks.gpu_check wheels
        downloads the pure-Python wheels of IPython, ipywidgets and nbval and of everything they
        need (the versions this venv runs, for Python 3.12 on x86-64 Linux) into WHEELS;
    make gpu-check    (there)         python -m benchmarks.gpu_check
        installs the wheels of what that machine lacks into SITE (--no-index --target), runs
        every test file that touches CUDA in parallel (pytest-xdist), then the GPU benchmarks
        (`python -m benchmarks gpu`, which writes the bench_gpu section of benchmarks/RESULTS.md),
        and reports in artifacts/gpu-check.md (whole outputs in artifacts/gpu-check-*.log).
        Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "artifacts/gpu-check.md"
WHEELS = ROOT / "artifacts/gpu-wheels"  # ignored (artifacts/); carried to the GPU machine
SITE = ROOT / "artifacts/gpu-site"      # where they are installed there (on PYTHONPATH)
NEEDED = ("ipython", "ipywidgets", "nbval")  # what the tests import that the machine lacks
PYTHON, PLATFORMS = "3.12", ("manylinux2014_x86_64", "manylinux_2_28_x86_64")
# 5 minutes in all: the tests, then the benchmarks (each stopped at its share, and said so).
TESTS_SECONDS, BENCH_SECONDS = 140, 145
_TARGET = {"python_version": PYTHON, "python_full_version": PYTHON + ".0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython",
           "extra": ""}
_CUDA = re.compile(r"\bcuda\b", re.I)


def _key(name: str) -> str:
    """A project name as wheel files and metadata compare it (PEP 503, '-' and '.' as '_')."""
    return re.sub(r"[-_.]+", "_", name).lower()


def closure(roots: tuple[str, ...] = NEEDED) -> dict[str, str]:
    """Every distribution the roots need on the GPU machine (markers read for Python 3.12 on
    Linux, extras left out), at the version installed here: {name: version}."""
    from packaging.requirements import Requirement

    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if _key(name) in map(_key, found):
            continue
        found[name] = metadata.version(name)
        for text in metadata.requires(name) or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(_TARGET):
                todo.append(req.name)
    return dict(sorted(found.items()))


def download_command(pins: dict[str, str], dest: Path) -> list[str]:
    """pip download of the pinned wheels for the GPU machine's Python and platform."""
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--python-version", PYTHON, *platforms, "-d", str(dest),
            *(f"{n}=={v}" for n, v in pins.items())]


def wheels() -> int:
    """`make gpu-wheels`: download the wheels into WHEELS (here, with PyPI reachable)."""
    pins = closure()
    WHEELS.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(download_command(pins, WHEELS))
    size = sum(f.stat().st_size for f in WHEELS.glob("*.whl")) / 2**20
    print(f"gpu-wheels: {len(pins)} distributions ({', '.join(pins)}) in {WHEELS.relative_to(ROOT)}, "
          f"{size:.1f} MiB; exit {done.returncode}")
    return done.returncode


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def missing_wheels(folder: Path = WHEELS) -> list[Path]:
    """The wheels in folder whose project this Python does not have installed."""
    return sorted(w for w in folder.glob("*.whl") if not _installed(w.name.split("-")[0]))


def install(folder: Path = WHEELS, site: Path = SITE) -> str:
    """Install what this machine lacks into site (no index, no dependency resolution)."""
    todo = missing_wheels(folder)
    if not todo:
        return "nothing to install (every wheel's project is present)"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           "--upgrade", "--target", str(site), *map(str, todo)],
                          capture_output=True, text=True)
    names = ", ".join(w.name.split("-")[0] for w in todo)
    return f"installed into {site.relative_to(ROOT)}: {names} (exit {done.returncode})" + (
        f"\n{done.stderr.strip()}" if done.returncode else "")


def cuda_tests(folder: Path = ROOT / "tests") -> list[str]:
    """The unit test files that touch CUDA (name it), relative to the repository."""
    return sorted(str(p.relative_to(ROOT)) for p in folder.glob("test_*.py")
                  if _CUDA.search(p.read_text()))


def _env() -> dict[str, str]:
    paths = [str(SITE), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _run(cmd: list[str], seconds: int) -> tuple[int | str, str, float]:
    """(exit code, or 'stopped after N s'; the output's tail; seconds taken). A command past its
    time is stopped with every process it started (xdist's workers too)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=seconds)
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = f"stopped after {seconds} s"
    return code, out or "", time.perf_counter() - t0


_BAD = re.compile(r"^(FAILED|ERROR)\b|\] (FAILED|ERROR) ")  # the summary's lines, or xdist's -v lines


def digest(out: str, keep: int = 30) -> str:
    """What a report shows of an output: every FAILED/ERROR line (up to 60), then its last lines."""
    lines = out.strip().splitlines()
    bad = [line for line in lines if _BAD.search(line)][:60]
    return "\n".join([*bad, *(["..."] if bad else []), *lines[-keep:]])


def pytest_command(files: list[str]) -> list[str]:
    """The tests in parallel when pytest-xdist is there (the GPU machine has it), each test's
    outcome on its own line as it ends (a run stopped at its share of time still names its
    failures), and a test that hangs stopped at 60 s when pytest-timeout is there."""
    # -v alone: "-q -v" cancel out, and xdist then prints dots again.
    parallel = ["-n", "auto", "-v"] if importlib.util.find_spec("xdist") else ["-q"]
    hung = ["--timeout", "60"] if importlib.util.find_spec("pytest_timeout") else []
    return [sys.executable, "-m", "pytest", "-rfEs", "-p", "no:cacheprovider", *parallel,
            *hung, *files]


def _cuda_summary() -> str:
    return ", ".join(f"{torch.cuda.get_device_name(i)} (compute capability "
                     f"{'.'.join(map(str, torch.cuda.get_device_capability(i)))})"
                     for i in range(torch.cuda.device_count()))


def main(argv: list[str]) -> int:
    if argv[:1] == ["wheels"]:
        return wheels()
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device on this machine (torch {torch.__version__}, "
              f"CUDA build: {torch.version.cuda or 'no'}); nothing to check, exiting 0")
        return 0
    installed = install() if WHEELS.exists() else f"no {WHEELS.relative_to(ROOT)}: run make gpu-wheels"
    files = cuda_tests()
    t_code, t_out, t_sec = _run(pytest_command(files), TESTS_SECONDS)
    b_code, b_out, b_sec = _run([sys.executable, "-m", "benchmarks", "gpu"], BENCH_SECONDS)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    for name, out in (("tests", t_out), ("bench", b_out)):  # the whole outputs, beside the report
        REPORT.with_name(f"gpu-check-{name}.log").write_text(out)
    t_tail, b_tail = digest(t_out), digest(b_out, keep=40)
    report = (f"# gpu-check\n\nDevices: {_cuda_summary()}; torch {torch.__version__}, CUDA "
              f"{torch.version.cuda}; Python {sys.version.split()[0]}\n\nWheels: {installed}\n\n"
              f"## Tests: the {len(files)} files that touch CUDA, in parallel ({t_sec:.0f} s; "
              f"exit {t_code})\n\n{' '.join(files)}\n\n```\n{t_tail}\n```\n\n"
              f"## GPU benchmarks ({b_sec:.0f} s; exit {b_code}; the bench_gpu section of "
              f"benchmarks/RESULTS.md)\n\n```\n{b_tail}\n```\n")
    REPORT.write_text(report)
    print(report)
    return next((c if isinstance(c, int) else 1 for c in (t_code, b_code) if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
