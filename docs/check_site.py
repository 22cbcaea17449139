"""After `make docs`: every tutorial page shows what its notebook draws (figures, widget state).

Figures and panels are looked for where the notebook's script draws them (a plot call, a panel),
so the check follows the tutorials as they change. A page with panels must load the widget
manager that ships with the site (docs/_static/widgets) and no script from the network, so the
panels appear offline; tests/browser/test_docs_site.py opens the pages in Chromium with the
network off and checks that each panel is drawn and responds. Exits 1 with one line per problem.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "build" / "docs"
DRAWS = re.compile(r"\bplot_\w+\(|\.plot\(|ax\s*=|Axes")
PANELS = re.compile(r"\b\w*Panel\(|RangeExplorer\(|\.panel\(")
MANAGER = "_static/widgets/embed.js"
REMOTE_SCRIPT = re.compile(r"<script[^>]*\bsrc=[\"'](?:https?:)?//", re.I)


def problems(site: Path = SITE) -> list[str]:
    """What is missing from the built site (empty when all is there)."""
    found = []
    for script in sorted((ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py")):
        page = site / "notebooks" / f"{script.stem}.html"
        if not page.exists():
            found.append(f"notebooks/{page.name}: not built")
            continue
        html, code = page.read_text(), script.read_text()
        if DRAWS.search(code) and "<img" not in html:
            found.append(f"{page.name}: the notebook draws figures, the page shows none")
        if PANELS.search(code) and not ("application/vnd.jupyter.widget-state+json" in html
                                        and "application/vnd.jupyter.widget-view+json" in html):
            found.append(f"{page.name}: the notebook shows panels, the page has no widget state")
        if "application/vnd.jupyter.widget-view+json" in html and MANAGER not in html:
            found.append(f"{page.name}: shows panels but does not load {MANAGER}")
        if REMOTE_SCRIPT.search(html):
            found.append(f"{page.name}: loads a script from the network: "
                         f"{REMOTE_SCRIPT.search(html).group(0)}")
    if not (site / MANAGER).exists():
        found.append(f"{MANAGER}: not in the site")
    for page in sorted((ROOT / "docs").glob("*.md")):  # start, the reference pages, the design
        if not (site / "docs" / f"{page.stem}.html").exists():
            found.append(f"docs/{page.stem}.html: not built")
    return found


if __name__ == "__main__":
    missing = problems(Path(sys.argv[1]) if len(sys.argv) > 1 else SITE)
    print("\n".join(missing) or "site complete")
    sys.exit(1 if missing else 0)
