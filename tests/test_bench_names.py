"""`python -m benchmarks NAME` runs exactly the benchmark named, and a name it lacks is an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import __main__ as bench_main

ROOT = Path(__file__).resolve().parents[1]


def test_names_are_the_bench_modules_without_their_prefix():
    files = sorted(p.stem.removeprefix("bench_") for p in (ROOT / "benchmarks").glob("bench_*.py"))
    assert bench_main.available() == files
    assert bench_main.modules(["fp16"]) == bench_main.modules(["bench_fp16"]) == ["bench_fp16"]
    assert bench_main.modules([]) == [f"bench_{n}" for n in files]


@pytest.mark.parametrize("name", ["fp", "bench_", "fp16x", "gp"])
def test_a_part_of_a_name_or_a_typo_is_not_a_match(name):
    with pytest.raises(ValueError, match=f"no benchmark named '{name.removeprefix('bench_')}'"):
        bench_main.modules([name])


def test_an_unknown_name_is_a_one_line_error_listing_the_benchmarks():
    done = subprocess.run([sys.executable, "-m", "benchmarks", "nosuch"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("python -m benchmarks: no benchmark named 'nosuch'")
    assert all(name in line for name in bench_main.available())
