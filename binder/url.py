"""Print the mybinder.org launch link of this checkout, derived from its GitHub remote.

    python binder/url.py                  # from `git remote get-url origin` (what `make binder-url` runs)
    python binder/url.py --ref my-branch  # a branch, tag or commit instead of the default branch

Binder builds a public repository from its host, so a link can only be derived from a remote
that is on GitHub; for any other remote (or none) this explains how to launch your fork instead.
Stdlib only: it runs before .venv exists.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "notebooks/00_quickstart.ipynb"  # what the link opens in JupyterLab
GITHUB = re.compile(
    r"^(?:(?:https?|git|ssh)://(?:[^@/]+@)?github\.com(?::\d+)?/|(?:[^@/:]+@)?github\.com:)"
    r"(?P<owner>[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)/(?P<name>[A-Za-z0-9._-]+?)(?:\.git)?/?$")
CREDENTIALS = re.compile(r"(?<=://)[^@/]+@")

HOW_TO = """\
No Binder link: {why}.
Binder builds a public repository from where it is hosted, so a launch link needs one.
To open the tutorials on Binder:
  1. push this repository (your fork) to GitHub;
  2. run `make binder-url` in a checkout whose `origin` is that GitHub repository
     (`{git_remote} https://github.com/<you>/<repository>.git`), or fill in the form
     at https://mybinder.org: GitHub repository <you>/<repository>, URL to open `/lab/tree/{notebook}`.
Binder installs binder/requirements.txt (a CPU-only torch and this package); `make binder-check`
runs every notebook in such an environment here first."""


def origin(root: Path = ROOT) -> str | None:
    """The URL of the checkout's `origin` remote, or None (no git, no such remote)."""
    try:
        done = subprocess.run(["git", "-C", str(root), "remote", "get-url", "origin"],
                              capture_output=True, text=True, check=False)
    except OSError:
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def github_repo(remote: str) -> str | None:
    """'owner/name' of a GitHub remote URL (https, ssh or scp-like), else None."""
    match = GITHUB.match(remote.strip())
    return f"{match['owner']}/{match['name']}" if match else None


def launch_url(repo: str, ref: str = "HEAD", notebook: str = NOTEBOOK) -> str:
    """The mybinder.org link that builds `repo` at `ref` and opens `notebook` in JupyterLab."""
    return f"https://mybinder.org/v2/gh/{repo}/{quote(ref, safe='')}?urlpath=lab/tree/{notebook}"


def explain(remote: str | None) -> str:
    """Why there is no link for this remote, and how to get one."""
    why = ("this checkout has no `origin` remote" if remote is None
           else f"`origin` ({CREDENTIALS.sub('', remote)}) is not a GitHub repository")
    # `origin` exists when it has a URL: it is pointed elsewhere, not added a second time.
    git_remote = "git remote add origin" if remote is None else "git remote set-url origin"
    return HOW_TO.format(why=why, notebook=NOTEBOOK, git_remote=git_remote)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="HEAD", help="branch, tag or commit (default: HEAD)")
    parser.add_argument("--remote", help="a remote URL instead of `git remote get-url origin`")
    args = parser.parse_args(argv)
    remote = args.remote or origin()
    repo = github_repo(remote) if remote else None
    print(launch_url(repo, args.ref) if repo else explain(remote))
    return 0


if __name__ == "__main__":
    sys.exit(main())
