"""`%%amp` in a real InteractiveShell against the same cell written with plain torch.autocast.

On a CPU a reported row splits the looping cell's extra time by phase (zero_grad, forward + loss,
backward, optimizer step): this thread's CPU time taken between the cell's own statements.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import textwrap
import time
from typing import Any

import torch

from benchmarks._common import Result, interleaved_medians, ms, one_thread, sync

# One training step of the demo transformer: what a learner puts in a %%amp cell.
CELL = """\
opt.zero_grad(set_to_none=True)
x, y = batches[0]
loss = loss_fn(model(x), y)
loss.backward()
opt.step()
"""
REPEAT, WARMUP = 31, 3
LOOP_STEPS, LOOP_REPEAT = 50, 15
COMPARE_REPEAT, COMPARE_ROUNDS = 3, 6
OVERHEAD_GOAL = 1.05
COMPARE_TOLERANCE = 0.10


def _shell(device: str) -> Any:
    from IPython.core.interactiveshell import InteractiveShell

    from ampnb.models import demo

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "ampnb")
    d = demo("gpt", seed=0, device=device)
    import ampnb.fp16_kernels

    ip.user_ns.update(ampnb=ampnb, torch=torch, model=d.model, opt=d.optimizer, loss_fn=d.loss_fn,
                      batches=d.batches)
    return ip, d


def _run(ip: Any, code: str) -> None:
    from IPython.utils.capture import capture_output

    with capture_output():  # what the magic displays is part of its cost; keep it off the terminal
        result = ip.run_cell(code, store_history=False, silent=False)
    result.raise_error()


# The same step written as torch's AMP recipe: autocast around forward and loss only.
RECIPE = """\
opt.zero_grad(set_to_none=True)
x, y = batches[0]
with torch.autocast({device!r}, dtype=torch.{dtype}):
    loss = loss_fn(model(x), y)
loss.backward()
opt.step()
"""


def _autocast_cell(body: str, dtype: torch.dtype, device: str) -> str:
    return (f"with torch.autocast({device!r}, dtype=torch.{str(dtype).removeprefix('torch.')}):\n"
            + textwrap.indent(body, "    "))


def _recipe_cell(mode: str, dtype: torch.dtype, device: str, steps: int = 0) -> str:
    """The recipe (a loop of `steps` when given), with the products run in the fp16 kernels
    %%amp picks for the mode here."""
    cell = RECIPE.format(device=device, dtype=str(dtype).removeprefix("torch."))
    if steps:
        cell = _looped(cell, steps)
    if dtype != torch.float16:
        return cell
    return ("with ampnb.fp16_kernels.fp16_kernel_context(" + repr(device) + "):\n"
            + textwrap.indent(cell, "    "))


def _looped(cell: str, steps: int) -> str:
    """The one-step cell as a loop of `steps`, each step on the next batch."""
    return (f"for _bench_i in range({steps}):\n"
            + textwrap.indent(cell.replace("batches[0]", "batches[_bench_i % len(batches)]"), "    "))


def _clock(device: str) -> Any:
    """This thread's CPU time on a CPU (one torch thread: the whole step runs here, and other
    processes on a shared machine do not count); wall time where a GPU does the work."""
    return time.thread_time if torch.device(device).type == "cpu" else time.perf_counter


def _overhead(ip: Any, mode: str, dtype: torch.dtype, device: str) -> list[Result]:
    hand, clock = _recipe_cell(mode, dtype, device), _clock(device)
    times = interleaved_medians({
        "hand": lambda: _run(ip, hand),
        "amp": lambda: _run(ip, f"%%amp {mode} --device {device}\n{CELL}"),
        "amp -q": lambda: _run(ip, f"%%amp {mode} --device {device} -q\n{CELL}"),
    }, repeat=REPEAT, warmup=WARMUP, device=device, clock=clock)
    # The same pair on a one-line cell: the fixed cost per cell, free of the step's noise.
    tiny = "_bench_z = 1\n"
    empty = interleaved_medians({
        "hand": lambda: _run(ip, _autocast_cell(tiny, dtype, device)),
        "amp": lambda: _run(ip, f"%%amp {mode} --device {device}\n{tiny}"),
    }, repeat=REPEAT, warmup=WARMUP, device=device, clock=clock)
    timed = "thread CPU time" if clock is time.thread_time else "wall time"
    name = f"%%amp {mode} overhead (demo gpt train step, {device}, 1 thread, {timed})"
    ratio, quiet = times["amp"] / times["hand"], times["amp -q"] / times["hand"]
    fixed = empty["amp"] - empty["hand"]
    return [
        Result(name, f"%%amp {ms(times['amp'])}, torch recipe cell {ms(times['hand'])}",
               ratio, f"<= {OVERHEAD_GOAL:.2f}x", ratio <= OVERHEAD_GOAL),
        Result(name.replace("overhead", "-q overhead"),
               f"%%amp -q {ms(times['amp -q'])}, torch recipe cell {ms(times['hand'])}",
               quiet, f"<= {OVERHEAD_GOAL:.2f}x", quiet <= OVERHEAD_GOAL),
        Result(f"  %%amp {mode} fixed cost per cell (one-line cell); / step time",
               f"%%amp {ms(empty['amp'])}, torch.autocast cell {ms(empty['hand'])}: "
               f"+{ms(fixed)}", fixed / times["hand"], "reported", None),
    ]


def _loop(ip: Any, mode: str, dtype: torch.dtype, device: str) -> list[Result]:
    """A 50-step loop in one %%amp cell against the same loop written with torch.autocast."""
    steps, clock = LOOP_STEPS, _clock(device)
    body, hand = _looped(CELL, steps), _recipe_cell(mode, dtype, device, steps)
    times = interleaved_medians({
        "hand": lambda: _run(ip, hand),
        "amp": lambda: _run(ip, f"%%amp {mode} --device {device} -q\n{body}"),
    }, repeat=LOOP_REPEAT, warmup=1, device=device, clock=clock)
    ratio = times["amp"] / times["hand"]
    per_step = (times["amp"] - times["hand"]) / steps
    rows = [Result(f"%%amp {mode} -q cell looping {steps} steps vs the same loop with "
                   f"torch.autocast (demo gpt, {device}, 1 thread)",
                   f"%%amp {ms(times['amp'])}, torch.autocast loop {ms(times['hand'])}: "
                   f"+{ms(per_step)} a step", ratio, f"<= {OVERHEAD_GOAL:.2f}x",
                   ratio <= OVERHEAD_GOAL)]
    if clock is time.thread_time:  # phases of an asynchronous GPU step are not its time
        rows.append(_where(ip, mode, dtype, device))
    return rows


PHASES = ("zero_grad", "forward + loss", "backward", "optimizer step")


def _phased(cell: str, steps: int) -> str:
    """The looped one-step cell with this thread's CPU time taken where each phase starts (one
    list per step in `_bench_phases`); an autocast block goes with forward + loss."""
    out = ["_bench_t = [_bench_clock()]"]
    for line in cell.splitlines():
        if line.startswith(("x, y", "loss.backward", "opt.step")):
            out.append("_bench_t.append(_bench_clock())")
        out.append(line)
    out += ["_bench_t.append(_bench_clock())", "_bench_phases.append(_bench_t)"]
    return _looped("\n".join(out) + "\n", steps)


def _where(ip: Any, mode: str, dtype: torch.dtype, device: str) -> Result:
    """Where a %%amp -q loop's extra time goes: each phase's median, %%amp minus torch.autocast."""
    got: dict[str, list[list[float]]] = {"hand": [], "amp": []}
    hand = _phased(RECIPE.format(device=device, dtype=str(dtype).removeprefix("torch.")),
                   LOOP_STEPS)
    if dtype == torch.float16:
        hand = ("with ampnb.fp16_kernels.fp16_kernel_context(" + repr(device) + "):\n"
                + textwrap.indent(hand, "    "))
    cells = {"hand": hand, "amp": f"%%amp {mode} --device {device} -q\n"
                                  + _phased(CELL, LOOP_STEPS)}
    ip.user_ns["_bench_clock"] = time.thread_time
    for k in range(LOOP_REPEAT // 3 + 1):  # the first round is warm-up
        for name, cell in cells.items():
            ip.user_ns["_bench_phases"] = found = []
            _run(ip, cell)
            if k:
                got[name] += [[b - a for a, b in zip(t, t[1:])] for t in found]
    med = {n: [statistics.median(p[i] for p in v) for i in range(len(PHASES))]
           for n, v in got.items()}
    extra = [a - h for a, h in zip(med["amp"], med["hand"])]
    return Result(f"  where the %%amp {mode} -q loop's extra time goes (phase medians a step)",
                  ", ".join(f"{n} {'+' if e >= 0 else '-'}{abs(e) * 1e6:.0f} µs"
                            for n, e in zip(PHASES, extra)),
                  sum(extra) / sum(med["hand"]), "reported", None)


def _hand_times(d: Any, dtype: torch.dtype, device: str) -> dict[str, list[float]]:
    """32-true and autocast step times, each run from fresh copies of the start (as --compare)."""
    start = copy.deepcopy((d.model, d.optimizer))
    x, y = d.batches[0]
    from ampnb.fp16_kernels import fp16_kernel_context

    contexts = {"fp32": contextlib.nullcontext, "amp": lambda: torch.autocast(device, dtype=dtype)}
    if dtype == torch.float16:
        def kernels():
            return fp16_kernel_context(device)
    else:
        kernels = contextlib.nullcontext
    times: dict[str, list[float]] = {k: [] for k in contexts}
    for k in range(1 + COMPARE_REPEAT):  # the first round is warm-up
        for key, ctx in contexts.items():
            model, opt = copy.deepcopy(start)
            torch.manual_seed(0)
            sync(device)
            t0 = time.perf_counter()
            with kernels():  # the recipe, in the products' kernels %%amp uses for the mode
                opt.zero_grad(set_to_none=True)
                with ctx():
                    loss = d.loss_fn(model(x), y)
                loss.backward()
                opt.step()
            sync(device)
            if k:
                times[key].append(time.perf_counter() - t0)
    return times


def _compare(ip: Any, d: Any, mode: str, dtype: torch.dtype, device: str) -> Result:
    """Rounds of (--compare, hand-written) so that load drift hits both; times pooled."""
    magic: dict[str, list[float]] = {"fp32": [], "amp": []}
    hand: dict[str, list[float]] = {"fp32": [], "amp": []}
    for _ in range(COMPARE_ROUNDS):
        _run(ip, f"%%amp --compare {mode} --device {device} -r {COMPARE_REPEAT} -q "
                 f"-o _bench_cmp\n{CELL}")
        found = ip.user_ns.pop("_bench_cmp").comparison
        magic["fp32"] += found.reference.times
        magic["amp"] += found.row(mode).times
        for key, values in _hand_times(d, dtype, device).items():
            hand[key] += values
    med = {k: statistics.median(v) for k, v in (("m32", magic["fp32"]), ("mamp", magic["amp"]),
                                                ("h32", hand["fp32"]), ("hamp", hand["amp"]))}
    got, ref = med["m32"] / med["mamp"], med["h32"] / med["hamp"]
    ratio = got / ref
    n = COMPARE_ROUNDS * COMPARE_REPEAT
    return Result(f"%%amp --compare {mode} speedup vs hand-written (demo gpt step, {device})",
                  f"--compare {got:.2f}x ({ms(med['m32'])} / {ms(med['mamp'])}), hand {ref:.2f}x "
                  f"({ms(med['h32'])} / {ms(med['hamp'])}), medians of {n}",
                  ratio, f"1 ± {COMPARE_TOLERANCE:.2f}", abs(ratio - 1) <= COMPARE_TOLERANCE)


def run() -> list[Result]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # 16-mixed on a CPU runs ampnb's emulated fp16 kernels; the recipe runs in the same ones.
    modes = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
    rows: list[Result] = []
    with one_thread():
        ip, d = _shell(device)
        try:
            for mode, dtype in modes.items():
                rows += _overhead(ip, mode, dtype, device)
                rows += _loop(ip, mode, dtype, device)
                rows.append(_compare(ip, d, mode, dtype, device))
        finally:
            ip.run_line_magic("unload_ext", "ampnb")
    return rows
