"""Run every benchmarks/bench_*.py (or those named on the command line) and print one table.

    python -m benchmarks              # all of them
    python -m benchmarks fp16 watch   # bench_fp16.py and bench_watch.py (`bench_fp16` works too)
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import traceback

import benchmarks
from benchmarks import results
from benchmarks._common import Result


def available() -> list[str]:
    """The benchmark modules, as `python -m benchmarks` names them (bench_fp16.py is `fp16`)."""
    return sorted(m.name.removeprefix("bench_") for m in pkgutil.iter_modules(benchmarks.__path__)
                  if m.name.startswith("bench_"))


def modules(selected: list[str]) -> list[str]:
    """The modules named exactly (`fp16` or `bench_fp16`), all when none; ValueError otherwise."""
    names = available()
    wanted = [s.removeprefix("bench_") for s in selected] or names
    unknown = [s for s in wanted if s not in names]
    if unknown:
        raise ValueError(f"no benchmark named {', '.join(map(repr, unknown))}; "
                         f"the benchmarks are: {', '.join(names)}")
    return [f"bench_{n}" for n in dict.fromkeys(wanted)]


def main(argv: list[str]) -> int:
    try:
        chosen = modules(argv)
    except ValueError as error:
        print(f"python -m benchmarks: {error}", file=sys.stderr)
        return 2
    rows: list[Result] = []
    by_module: dict[str, list[Result]] = {}
    for name in chosen:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            found = importlib.import_module(f"benchmarks.{name}").run()
            by_module[name] = found
        except Exception:  # noqa: BLE001 - one broken benchmark must not hide the others
            traceback.print_exc()
            found = [Result(name, "error (see above)", None, "-", False)]
        rows.extend(found)
    headers = ("benchmark", "measured", "ratio", "goal", "met")
    cells = [(r.name, r.figure, "-" if r.ratio is None else f"{r.ratio:.2f}", r.goal,
              {True: "yes", False: "NO", None: "n/a"}[r.ok]) for r in rows]
    widths = [max(len(str(c[i])) for c in [headers, *cells]) for i in range(len(headers))]
    for k, c in enumerate([headers, *cells]):
        print("  ".join(str(x).ljust(w) for x, w in zip(c, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))
    if by_module:
        print(f"results written to {results.write(by_module)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
