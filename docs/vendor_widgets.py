"""Vendor the widget manager the docs site uses to draw the panels: `@jupyter-widgets/html-manager`.

    .venv/bin/python docs/vendor_widgets.py [VERSION]

Downloads the package's tarball from the npm registry, checks it against the registry's sha512
integrity, and writes the standalone bundle (`dist/embed.js`: the manager with the base,
controls and output widgets, no require.js needed), its third-party licences and the icon fonts
it loads beside itself into docs/_static/widgets/. The files are committed, so `make docs` and
the site work offline (a workshop room, CI without network). Stdlib only.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import sys
import tarfile
import urllib.request
from pathlib import Path

PACKAGE = "@jupyter-widgets/html-manager"
VERSION = "1.0.15"  # for ipywidgets 8 (controls 5.x, widget state version 2.0.0)
OUT = Path(__file__).resolve().parent / "_static" / "widgets"
KEEP = ("dist/embed.js", "dist/embed.js.LICENSE.txt")


def fetch(version: str = VERSION, out: Path = OUT) -> list[Path]:
    """Download, verify and unpack the bundle; return the files written."""
    with urllib.request.urlopen(f"https://registry.npmjs.org/{PACKAGE}/{version}") as reply:
        dist = json.load(reply)["dist"]
    with urllib.request.urlopen(dist["tarball"]) as reply:
        data = reply.read()
    algorithm, expected = dist["integrity"].split("-", 1)
    if base64.b64encode(hashlib.new(algorithm, data).digest()).decode() != expected:
        raise SystemExit(f"{dist['tarball']}: integrity check failed")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            name = member.name.removeprefix("package/")
            if name in KEEP or (name.startswith("dist/") and name.endswith(".woff2")):
                target = out / Path(name).name
                target.write_bytes(tar.extractfile(member).read())
                written.append(target)
    (out / "VERSION").write_text(f"{PACKAGE}@{version} {dist['integrity']}\n")
    return written


if __name__ == "__main__":
    for path in fetch(*sys.argv[1:2]):
        print(path.relative_to(OUT.parents[1]))
