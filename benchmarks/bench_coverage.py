"""Coverage of a 16M-element float32 tensor in fp16, bf16, e4m3, e5m2 plus its log2 histogram:
ampnb (a 16-bit key from the bit pattern + one bincount, on the tensor's device; on CPU with
the eager kernel and with the compiled one) vs numpy computing the same counts."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from benchmarks._common import Result, interleaved_medians, ms

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
    from ampnb.instruments.coverage_stats import _cut_points, segment_stats
    from ampnb.instruments.kernels import coverage_backend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = _data(device)
    fmts = [get_format(f) for f in FORMATS]
    work = get_format("fp32")
    cuts = {f.name: _cut_points(f, work) for f in fmts}
    bounds = sorted({0.0, work.smallest_subnormal, math.inf, *(c for cs in cuts.values() for c in cs)})
    host = x.cpu().numpy()

    def ours():
        return segment_stats(x, [N], fmts)[0]

    def compiled():
        coverage_backend("compiled")
        try:
            return ours()
        finally:
            coverage_backend("eager")

    def theirs():
        return _numpy_counts(host, bounds)

    t0 = time.perf_counter()
    try:  # the one-off cost a session pays when it selects the compiled kernel
        coverage_backend("compiled")
        build = time.perf_counter() - t0
    except RuntimeError as e:
        build, why = None, str(e)
    finally:
        coverage_backend("eager")
    fns = {"ampnb": ours, "numpy": theirs, "one pass": lambda: x.sum()}
    if build is not None and device == "cpu":
        fns["compiled"] = compiled
    t = interleaved_medians(fns, repeat=5, warmup=1, device=device)
    ge, np_hist, n_nan = theirs()

    def agrees(result) -> bool:
        covs, hist = result
        return list(hist) == np_hist.tolist() and all(
            covs[f].n_overflow == ge[cuts[f][2]] - ge[math.inf]
            and covs[f].n_underflow == ge[work.smallest_subnormal] - ge[cuts[f][0]]
            and covs[f].n_nonfinite == N - ge[0.0] + ge[math.inf] for f in covs) and n_nan == 10

    where = f"{device}, {torch.get_num_threads()} threads" if device == "cpu" else device
    rows = []
    for key, label in (("ampnb", "eager kernel, the default"), ("compiled", "compiled kernel")):
        if key not in t:
            continue
        same = agrees(ours() if key == "ampnb" else compiled())
        speedup = t["numpy"] / t[key]
        agree = "counts agree" if same else "COUNTS DIFFER"
        rows.append(Result(
            f"coverage 16M float32, 4 formats + log2 histogram, vs numpy ({where}; {label})",
            f"ampnb {ms(t[key])}, numpy {ms(t['numpy'])}; {agree}",
            speedup, ">= 5x", speedup >= 5 and same))
    if device == "cpu":
        rows.append(Result("compiled coverage kernel: one-off build (torch.compile + check)",
                           f"{build:.1f} s" if build is not None else why, None, "reported", None))
    best = min(t.get("compiled", math.inf), t["ampnb"])
    rows.append(Result(f"coverage vs one memory pass (x.sum(), {where})",
                       f"ampnb {ms(best)}, one pass {ms(t['one pass'])}",
                       best / t["one pass"], "reported", None))
    return rows
