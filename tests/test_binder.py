"""Binder's files agree with the project: same package, CPU-only torch, notebooks that exist."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# A Binder launch link: ...mybinder.org/v2/<provider>/<repo>/<ref>?urlpath=lab/tree/<path>
LINK = re.compile(r"https://mybinder\.org/v2/[^)\s\"']*?urlpath=([^)\s\"'&]+)")


def _lines(path: Path) -> list[str]:
    """The meaningful lines of a pip requirements file (no comments, no blanks)."""
    out = []
    for raw in path.read_text("utf-8").splitlines():
        line = raw.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _requirements() -> dict[str, Requirement]:
    reqs = {}
    for line in _lines(BINDER / "requirements.txt"):
        if line.startswith("-") or line in (".", "-e ."):
            continue
        req = Requirement(line)
        reqs[req.name.lower()] = req
    return reqs


def _pyproject_dependency(name: str) -> Requirement:
    deps = [Requirement(d) for d in PYPROJECT["project"]["dependencies"]]
    return next(d for d in deps if d.name.lower() == name)


def _pinned(req: Requirement) -> Version:
    (spec,) = req.specifier
    assert spec.operator in ("==", "==="), f"torch must be pinned exactly in Binder, got {req}"
    return Version(spec.version)


def test_binder_installs_this_repository_last():
    lines = _lines(BINDER / "requirements.txt")
    # "." is pip's path to the repository root, where pyproject.toml names the package.
    assert lines[-1] in (".", "-e ."), lines[-1]
    assert PYPROJECT["project"]["name"] == "ampnb"
    assert (ROOT / "ampnb" / "__init__.py").exists()


def test_binder_torch_is_the_cpu_build_pyproject_allows():
    options = [shlex.split(x) for x in _lines(BINDER / "requirements.txt") if x.startswith("-")]
    indexes = [o[1] for o in options if o[0] in ("--extra-index-url", "--index-url")]
    assert CPU_INDEX in indexes
    torch = _requirements()["torch"]
    version = _pinned(torch)
    # "+cpu" picks the CPU wheel even though PyPI has the CUDA one with the same version.
    assert version.local == "cpu"
    assert version in SpecifierSet(str(_pyproject_dependency("torch").specifier))


def test_binder_torch_matches_the_makefile_default():
    make = (ROOT / "Makefile").read_text("utf-8")
    default = re.search(r"^TORCH\s*\?=\s*(\S+)", make, re.M)
    assert default, "Makefile has no `TORCH ?=` default"
    made = _pinned(Requirement(default.group(1)))
    assert _pinned(_requirements()["torch"]).public == made.public


def test_binder_pulls_no_cuda_packages():
    names = set(_requirements())
    assert not {n for n in names if n.startswith(("nvidia-", "triton", "cuda"))}


def test_binder_python_satisfies_requires_python():
    runtime = BINDER / "runtime.txt"
    if not runtime.exists():
        pytest.skip("no binder/runtime.txt: repo2docker's default Python is used")
    version = runtime.read_text("utf-8").strip().removeprefix("python-")
    assert Version(version) in SpecifierSet(PYPROJECT["project"]["requires-python"])


def test_every_binder_link_opens_a_notebook_that_exists():
    paths = []
    for doc in (ROOT / "README.md", BINDER / "README.md", ROOT / "notebooks" / "README.md"):
        if doc.exists():
            paths += LINK.findall(doc.read_text("utf-8"))
    assert paths, "no mybinder.org launch link with urlpath= in README.md or binder/README.md"
    for urlpath in paths:
        assert urlpath.startswith("lab/tree/"), f"{urlpath}: open it in JupyterLab"
        target = ROOT / urlpath.removeprefix("lab/tree/")
        assert target.suffix == ".ipynb" and target.exists(), f"{urlpath} -> missing {target}"
    assert "lab/tree/notebooks/00_quickstart.ipynb" in paths
