"""LLM.int8(): int8 activations x int8 weights, with outlier features (|x| >= 6) kept in 16 bits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ampnb.display import Table, TableView
from ampnb.lowbit.formats import INV_127, int8_rowwise

# bitsandbytes' Linear8bitLt default, and Lightning's (`_Linear8bitLt(threshold=6.0)`).
THRESHOLD = 6.0


def int8_vectorwise_quant(x: torch.Tensor, threshold: float = 0.0
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bitsandbytes' `int8_vectorwise_quant`: (int8 rows, fp32 row absmax, outlier columns).

    A column (feature) with any |x| >= threshold is an outlier feature: its values are left out
    of the row absmax and zeroed in the int8 rows, because they take the 16-bit path.
    """
    rows = x.reshape(-1, x.shape[-1])
    cols = torch.empty(0, dtype=torch.long, device=x.device)
    inliers = rows
    if threshold > 0.0:
        outliers = rows.abs() >= threshold
        cols = torch.argwhere(outliers.any(dim=0)).view(-1)
        inliers = rows.masked_fill(outliers, 0)
    codes, stats = int8_rowwise(inliers)
    if rows.shape[0] > 1 and cols.numel():
        codes[:, cols] = 0
    return codes, stats, cols


def int8_matmul(x: torch.Tensor, w_codes: torch.Tensor, w_stats: torch.Tensor,
                w16: torch.Tensor, bias: torch.Tensor | None = None,
                threshold: float = THRESHOLD) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ W^T the LLM.int8() way, in fp16: (output, outlier feature indices).

    Inliers: int8 x int8 with exact integer sums, rescaled by row absmax x column absmax / 127².
    Outlier features: x's columns times W16's columns in 16 bits (W16 is the fp16 weight for
    int8-training, the int8 weight dequantized for int8, which keeps no 16-bit copy).
    """
    x16 = x.to(torch.float16)
    rows = x16.reshape(-1, x16.shape[-1])
    a_codes, a_stats, cols = int8_vectorwise_quant(rows, threshold)
    acc = a_codes.double() @ w_codes.double().t()  # exact: every partial sum is an integer < 2^53
    out = acc.float() * (a_stats[:, None] * w_stats[None, :]) * (INV_127 * INV_127)
    if bias is not None:
        out = out + bias.float()
    out = out.to(torch.float16)
    if cols.numel():
        out = out.addmm(rows[:, cols], w16[:, cols].to(torch.float16).t())
    return out.reshape(*x.shape[:-1], w_codes.shape[0]), cols


@dataclass(frozen=True, repr=False)
class Int8Split(TableView):
    """Which features of an activation go LLM.int8()'s 16-bit path, and the error either way."""

    threshold: float
    features: int
    outlier_features: tuple[int, ...]
    sqnr_decomposed_db: float
    sqnr_int8_only_db: float

    def table(self) -> Table:
        shown = ", ".join(map(str, self.outlier_features[:12])) + (" …" if len(self.outlier_features) > 12 else "")
        return Table(("threshold", "features", "outlier features (16-bit path)", "output SQNR dB",
                      "all-int8 SQNR dB"),
                     [(f"{self.threshold:g}", str(self.features),
                       f"{len(self.outlier_features)}: {shown or '-'}",
                       f"{self.sqnr_decomposed_db:.1f}", f"{self.sqnr_int8_only_db:.1f}")],
                     caption="LLM.int8(): |x| >= threshold in any row sends that feature to fp16")


def int8_split(x: torch.Tensor, w: torch.Tensor, threshold: float = THRESHOLD) -> Int8Split:
    """Measure LLM.int8() on one activation x and weight w (out, in) against the fp32 product."""
    from ampnb.fp8.scaling import sqnr

    if threshold < 0:
        raise ValueError(f"threshold={threshold!r} is not allowed; allowed: a number >= 0 (0 = no outliers)")
    w_codes, w_stats = int8_rowwise(w.detach().half().float())
    w16 = (w_codes.float() * w_stats[:, None] * INV_127).half()
    ref = x.detach().float() @ w.detach().float().t()
    with torch.no_grad():
        mixed, cols = int8_matmul(x, w_codes, w_stats, w16, threshold=threshold)
        plain, _ = int8_matmul(x, w_codes, w_stats, w16, threshold=0.0)
    return Int8Split(threshold, x.shape[-1], tuple(cols.tolist()), sqnr(ref, mixed.float()),
                     sqnr(ref, plain.float()))
