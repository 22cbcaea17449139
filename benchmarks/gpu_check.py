"""`make gpu-check`: every CUDA-only test and the GPU benchmarks, with a short report.

On a machine without CUDA it says so and exits 0. The report goes to artifacts/gpu-check.md.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

REPORT = Path("artifacts/gpu-check.md")


def _cuda_summary() -> str:
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    caps = [".".join(map(str, torch.cuda.get_device_capability(i)))
            for i in range(torch.cuda.device_count())]
    return ", ".join(f"{n} (compute capability {c})" for n, c in zip(names, caps))


def main() -> int:
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device on this machine (torch {torch.__version__}, "
              f"CUDA build: {torch.version.cuda or 'no'}); nothing to check, exiting 0")
        return 0
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                            "tests", "--ignore=tests/browser"], capture_output=True, text=True)
    bench = subprocess.run([sys.executable, "-m", "benchmarks", "gpu", "magics", "fp8"],
                           capture_output=True, text=True)
    tail = "\n".join(tests.stdout.strip().splitlines()[-15:])
    report = (f"# gpu-check\n\nDevices: {_cuda_summary()}; torch {torch.__version__}, CUDA "
              f"{torch.version.cuda}\n\n## Tests (all unit tests, CUDA-only ones included; "
              f"exit {tests.returncode})\n\n```\n{tail}\n```\n\n## GPU benchmarks (exit "
              f"{bench.returncode})\n\n```\n{bench.stdout.strip()}\n```\n")
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(report)
    print(report)
    return tests.returncode or bench.returncode


if __name__ == "__main__":
    sys.exit(main())
