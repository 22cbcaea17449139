"""Coverage of a 16M-element float32 tensor in fp16, bf16, e4m3, e5m2 plus its log2 histogram:
ampnb (a 16-bit key from the bit pattern + one bincount, on the tensor's device) vs numpy
computing the same counts; on CPU with torch's threads and with one thread (numpy uses one)."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from benchmarks._common import Result, interleaved_medians, ms, one_thread

N = 16 * 2**20
FORMATS = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")


def _data(device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    # Magnitudes spread over 2^-40 .. 2^20, so every format over- and underflows somewhere.
    x = torch.randn(N, generator=g) * torch.exp2(torch.empty(N).uniform_(-40, 20, generator=g))
    x[:1000] = 0.0
    x[1000:1010] = math.inf
    x[1010:1020] = math.nan
    return x.to(device)


def _numpy_counts(a: np.ndarray, bounds: list[float]) -> tuple[dict[float, int], np.ndarray, int]:
    """How many |x| >= b for each boundary, the log2 histogram, and the NaN count, in numpy."""
    from ampnb.instruments.coverage_stats import EXP_BINS, EXP_MIN

    m = np.abs(a)
    ge = {b: int(np.count_nonzero(m >= b)) for b in bounds}
    finite_nz = m[np.isfinite(m) & (m > 0)]
    e = np.frexp(finite_nz)[1].astype(np.int64) - 1  # floor(log2|x|)
    n_bins = len(EXP_BINS) - 1  # EXP_BINS are the edges' exponents: bin i is [2^(EXP_MIN+i), ..)
    hist = np.bincount(np.clip(e - EXP_MIN, 0, n_bins - 1), minlength=n_bins)
    return ge, hist, int(np.count_nonzero(np.isnan(m)))


def run() -> list[Result]:
    from ampnb.formats import get_format
    from ampnb.instruments.coverage_stats import cut_points, segment_stats

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = _data(device)
    fmts = [get_format(f) for f in FORMATS]
    work = get_format("fp32")
    cuts = {f.name: cut_points(f, work) for f in fmts}
    bounds = sorted({0.0, work.smallest_subnormal, math.inf, *(c for cs in cuts.values() for c in cs)})
    host = x.cpu().numpy()

    def ours():
        return segment_stats(x, [N], fmts)[0]

    def theirs():
        return _numpy_counts(host, bounds)

    fns = {"ampnb": ours, "numpy": theirs, "one pass": lambda: x.sum()}
    t = interleaved_medians(fns, repeat=7, warmup=1, device=device)
    if device == "cpu":  # both on one thread: thread CPU time, which other processes do not
        # inflate (numpy's own figure then excludes time spent waiting for the CPU, too)
        with one_thread():  # set once: switching threads per call costs more than a pass
            one_t = interleaved_medians({"1 thread": ours, "numpy": theirs}, repeat=7,
                                        warmup=1, clock=time.thread_time)
        t["1 thread"], t["numpy 1 thread"] = one_t["1 thread"], one_t["numpy"]
    ge, np_hist, n_nan = theirs()
    covs, hist = ours()
    same = list(hist) == np_hist.tolist() and n_nan == 10 and all(
        covs[f].n_overflow == ge[cuts[f][2]] - ge[math.inf]
        and covs[f].n_underflow == ge[work.smallest_subnormal] - ge[cuts[f][0]]
        and covs[f].n_nonfinite == N - ge[0.0] + ge[math.inf] for f in covs)
    agree = "counts agree" if same else "COUNTS DIFFER"
    where = f"{device}, {torch.get_num_threads()} threads" if device == "cpu" else device
    rows = []
    for key, ref, label in (("ampnb", "numpy", f"{where}, wall time"),
                            ("1 thread", "numpy 1 thread", f"{device}, 1 torch thread, "
                                                           f"thread CPU time")):
        if key in t:
            speedup = t[ref] / t[key]
            rows.append(Result(
                f"coverage 16M float32, 4 formats + log2 histogram, vs numpy ({label})",
                f"ampnb {ms(t[key])}, numpy {ms(t[ref])}; {agree}",
                speedup, ">= 5x", speedup >= 5 and same))
    rows.append(Result(f"coverage vs one memory pass (x.sum(), {where})",
                       f"ampnb {ms(t['ampnb'])}, one pass {ms(t['one pass'])}",
                       t["ampnb"] / t["one pass"], "reported", None))
    return rows
