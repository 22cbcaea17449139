"""Binder's files agree with the project: same package, CPU-only torch, notebooks that exist."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _magics_kit import load_script
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The docs that offer Binder: the README, Binder's and the notebooks' own, the site's start page.
DOCS = (ROOT / "README.md", BINDER / "README.md", ROOT / "notebooks" / "README.md",
        ROOT / "docs" / "start.md")
# A Binder launch link: ...mybinder.org/v2/<provider>/<repo>/<ref>?urlpath=lab/tree/<path>
LINK = re.compile(r"https://mybinder\.org/v2/([^?)\s\"']+)\?urlpath=([^)\s\"'&]+)")
# What docs put where the account belongs when they do not know it.
PLACEHOLDER = re.compile(r"^(owner|user|username|you|your[-_]?\w*|org|organi[sz]ation|account|"
                         r"example|name|repo|repository)$|[<>{}]|xxx", re.I)


url = load_script(BINDER / "url.py", "binder_url")


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


def _links() -> dict[str, list[tuple[str, str]]]:
    """Every mybinder.org launch link in the docs: doc name -> [(repository path, urlpath)]."""
    return {doc.relative_to(ROOT).as_posix(): LINK.findall(doc.read_text("utf-8"))
            for doc in DOCS if doc.exists()}


def link_problems(repo_path: str, urlpath: str) -> list[str]:
    """Why a launch link cannot work: a placeholder for the repository, or a missing notebook."""
    problems = []
    provider, _, rest = repo_path.partition("/")
    parts = rest.split("/")
    if provider != "gh" or len(parts) != 3 or not url.github_repo(f"https://github.com/{'/'.join(parts[:2])}"):
        problems.append(f"v2/{repo_path}: not v2/gh/<owner>/<repository>/<ref>")
    elif PLACEHOLDER.search(parts[0]) or PLACEHOLDER.search(parts[1]):
        problems.append(f"v2/{repo_path}: {parts[0]}/{parts[1]} is a placeholder, not a repository")
    if not urlpath.startswith("lab/tree/"):
        problems.append(f"{urlpath}: open it in JupyterLab (urlpath=lab/tree/...)")
    target = ROOT / urlpath.removeprefix("lab/tree/")
    if target.suffix != ".ipynb" or not target.exists():
        problems.append(f"{urlpath} -> missing {target.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("example", [
    ("gh/OWNER/ampnb/HEAD", "lab/tree/notebooks/00_quickstart.ipynb"),
    ("gh/your-username/ampnb/HEAD", "lab/tree/notebooks/00_quickstart.ipynb"),
    ("gh/<you>/ampnb/HEAD", "lab/tree/notebooks/00_quickstart.ipynb"),
    ("gh/someone/ampnb/HEAD", "lab/tree/notebooks/00_quick.ipynb"),
    ("gh/someone/ampnb/HEAD", "tree/notebooks/00_quickstart.ipynb"),
])
def test_a_link_that_cannot_work_is_caught(example):
    assert link_problems(*example)


def test_a_derived_link_passes_the_same_check():
    link = url.launch_url("someone/ampnb")
    ((repo_path, urlpath),) = LINK.findall(link)
    assert link_problems(repo_path, urlpath) == []


def test_no_binder_link_in_the_docs_is_a_placeholder_or_opens_a_missing_notebook():
    problems = [f"{doc}: {p}" for doc, links in _links().items()
                for link in links for p in link_problems(*link)]
    assert not problems, "\n".join(problems)


def test_the_docs_say_how_to_get_a_binder_link_where_they_offer_none():
    # A link is only derivable from a real remote: each doc without one names `make binder-url`.
    for doc, links in _links().items():
        text = (ROOT / doc).read_text("utf-8")
        assert links or "make binder-url" in text, f"{doc}: no Binder link and no `make binder-url`"


@pytest.mark.parametrize(("remote", "repo"), [
    ("https://github.com/someone/ampnb.git", "someone/ampnb"),
    ("https://github.com/someone/ampnb", "someone/ampnb"),
    ("https://user:secret@github.com/some-one/amp.nb.git", "some-one/amp.nb"),
    ("git@github.com:someone/ampnb.git", "someone/ampnb"),
    ("ssh://git@github.com:22/someone/ampnb.git", "someone/ampnb"),
    ("https://gitlab.com/someone/ampnb.git", None),
    ("https://github.com.evil.example/someone/ampnb.git", None),
    ("/srv/git/ampnb.git", None),
])
def test_binder_url_reads_the_repository_from_a_github_remote(remote, repo):
    assert url.github_repo(remote) == repo


def test_binder_url_links_the_quickstart_at_a_quoted_ref():
    link = url.launch_url("someone/ampnb", ref="feature/x")
    assert link == ("https://mybinder.org/v2/gh/someone/ampnb/feature%2Fx"
                    "?urlpath=lab/tree/notebooks/00_quickstart.ipynb")
    assert (ROOT / url.NOTEBOOK).exists()


def _git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_make_binder_url_prints_the_link_of_a_github_origin(tmp_path, capsys):
    _git("init", "-q", cwd=tmp_path)
    assert url.origin(tmp_path) is None
    _git("remote", "add", "origin", "git@github.com:someone/ampnb.git", cwd=tmp_path)
    assert url.origin(tmp_path) == "git@github.com:someone/ampnb.git"
    url.main(["--remote", url.origin(tmp_path)])
    assert capsys.readouterr().out.strip() == url.launch_url("someone/ampnb")


def test_make_binder_url_explains_without_a_github_origin_and_shows_no_secret(capsys):
    url.main(["--remote", "https://user:secret@gitlab.example/team/ampnb.git"])
    out = capsys.readouterr().out
    assert "No Binder link" in out and "secret" not in out and "mybinder.org/v2" not in out
    assert "gitlab.example/team/ampnb.git" in out
    assert url.explain(None).startswith("No Binder link: this checkout has no `origin` remote")


def test_the_makefile_offers_binder_url_and_binder_check():
    make = (ROOT / "Makefile").read_text("utf-8")
    assert re.search(r"^binder-url:.*\n\t@?\$\(PYTHON\) binder/url\.py", make, re.M)
    assert re.search(r"^binder-check:", make, re.M)
    assert "make binder-check" in (ROOT / ".ci" / "run").read_text("utf-8")


# Binder's environment for real. Slow (a fresh venv and every notebook), so it runs under
# `make binder-check` (called by .ci/run), not `make unit`.
BINDER_CHECK = os.environ.get("AMPNB_BINDER_CHECK") == "1"
BINDER_MEMORY = 2 * 10**9  # Binder gives a session 1-2 GB
# What repo2docker's image brings itself (it runs Jupyter), plus nbval and pytest-timeout
# (pyproject's per-test timeout) to check the outputs.
NOTEBOOK_TOOLS = ["ipykernel", "nbval", "pytest-timeout"]
INDEX_OPTIONS = ("--index-url", "--extra-index-url", "-i")
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "artifacts", "build", "dist", "*.egg-info",
                                     "__pycache__", ".*_cache", ".ipynb_checkpoints")


def without_index_options(text: str) -> str:
    """The requirements with their index lines left out, so pip uses its configured indexes."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.strip().startswith(INDEX_OPTIONS))


def test_index_lines_are_the_only_ones_left_out_for_the_local_install():
    text = (BINDER / "requirements.txt").read_text("utf-8")
    local = without_index_options(text)
    dropped = set(text.splitlines()) - set(local.splitlines())
    assert dropped == {f"--extra-index-url {CPU_INDEX}"}
    assert "torch==" in local and local.splitlines()[-1] == "."


def _run_measured(cmd: list[str], cwd: Path, env: dict, log: Path) -> tuple[int, float, int]:
    """Exit code, seconds and peak RSS in bytes of the largest process in cmd's tree."""
    with log.open("wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        # wait4's rusage is RUSAGE_CHILDREN of this one child: ru_maxrss covers every process it
        # reaped (pytest, each kernel, the ranks notebook 06 starts), not the tests run before.
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.perf_counter() - t0, usage.ru_maxrss * 1024


@pytest.mark.timeout(1800)
@pytest.mark.skipif(not BINDER_CHECK, reason="slow (~8 min): `make binder-check` runs it")
def test_a_fresh_venv_from_binder_requirements_alone_runs_every_notebook(tmp_path):
    # Binder clones the repository and installs binder/requirements.txt, nothing else from here.
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=COPY_IGNORE)
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(without_index_options((BINDER / "requirements.txt").read_text()))
    venv, timings = tmp_path / "venv", {}
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--no-compile"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env |= {"PYTHONNOUSERSITE": "1", "JUPYTER_DATA_DIR": str(tmp_path / "jupyter"),
            "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter-config"), "MPLBACKEND": "agg"}
    steps = [
        ("venv", [sys.executable, "-m", "venv", str(venv)]),
        # --no-compile: byte-compiling all of torch is minutes of CPU that Python does on import.
        ("pip install -r binder/requirements.txt", [*pip, "-r", str(requirements)]),
        ("pip install " + " ".join(NOTEBOOK_TOOLS), [*pip, *NOTEBOOK_TOOLS]),
    ]
    for name, cmd in steps:
        rc, seconds, _ = _run_measured(cmd, repo, env, tmp_path / "step.log")
        timings[name] = seconds
        assert rc == 0, f"{name} failed:\n{(tmp_path / 'step.log').read_text()[-3000:]}"
    installed = subprocess.run([str(python), "-c", "import ampnb, torch; print(ampnb.__file__, "
                                "torch.__version__)"], cwd=tmp_path, env=env, check=True,
                               capture_output=True, text=True).stdout
    assert str(venv) in installed and "+cpu" in installed, installed
    notebooks = sorted(p.relative_to(repo).as_posix() for p in (repo / "notebooks").glob("[0-9]*.ipynb"))
    nbval = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
             "--nbval-sanitize-with", "notebooks/src/sanitize.cfg", *notebooks]
    log = tmp_path / "nbval.log"
    rc, timings["nbval, every notebook"], peak = _run_measured(nbval, repo, env, log)
    summary = "; ".join(f"{k} {v:.0f} s" for k, v in timings.items())
    print(f"\nbinder-check: {summary}; peak RSS {peak / 2**20:.0f} MiB (largest process)")
    assert rc == 0, f"nbval in Binder's environment failed:\n{log.read_text()[-6000:]}"
    assert peak <= BINDER_MEMORY, f"peak RSS {peak / 2**20:.0f} MiB > Binder's 2 GB"


@pytest.mark.parametrize("existing", [None, "https://gitlab.example/team/ampnb.git"])
def test_the_git_command_binder_url_advises_works_in_that_checkout(tmp_path, existing):
    _git("init", "-q", cwd=tmp_path)
    if existing:
        _git("remote", "add", "origin", existing, cwd=tmp_path)
    advice = url.explain(url.origin(tmp_path))
    (command,) = re.findall(r"`(git remote [^`]+)`", advice)
    fork = "https://github.com/someone/ampnb.git"
    _git(*shlex.split(command.replace("https://github.com/<you>/<repository>.git", fork))[1:],
         cwd=tmp_path)  # fails as `git remote add origin` would where origin exists
    assert url.github_repo(url.origin(tmp_path)) == "someone/ampnb"
