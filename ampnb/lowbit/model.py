"""Lightning's BitsandbytesPrecision.convert_module: Linear / Conv1D layers replaced, error per layer."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampnb._interrupt import Guard, deferred
from ampnb.display import Table, TableView, dtype_name, format_bytes
from ampnb.fp8.layers import (
    CONVERTIBLE,
    ParameterShare,
    describe_left_out,
    kind_of,
    left_out,
    left_out_notes,
    parameter_share,
    swap_children,
)
from ampnb.fp8.scaling import sqnr
from ampnb.lowbit.formats import INV_127, LowBitFormat, get_lowbit, quantize_weight
from ampnb.lowbit.inputs import run_inputs
from ampnb.lowbit.int8 import THRESHOLD
from ampnb.lowbit.layers import LOWBIT_LAYERS, Linear4bit, Linear8bitLt
from ampnb.putback import fastpath_off, rng_kept


@dataclass(frozen=True)
class LayerError:
    """What a low-bit format did to one Linear / Conv1D layer (shape as (out, in))."""

    name: str
    shape: tuple[int, ...]
    bits_per_param: float
    weight_sqnr_db: float
    max_abs_error: float
    output_sqnr_db: float | None = None
    kind: str = "Linear"
    outlier_features: tuple[int, ...] | None = None  # int8 modes: inputs that went the fp16 path


@dataclass(frozen=True, repr=False)
class LowBitReport(TableView):
    """Per-layer storage and error of a weight-only low-bit model, and what it left out."""

    fmt: LowBitFormat
    layers: tuple[LayerError, ...]
    left_out: tuple[tuple[str, int], ...] = ()  # other modules with parameters, by type
    dtype: torch.dtype = torch.bfloat16  # the compute dtype
    real: bool = False      # bitsandbytes' own layers (CUDA) rather than the emulation
    already: bool = False   # the model held low-bit layers: nothing was replaced
    params: ParameterShare = ParameterShare()  # the quantized weights among all parameters
    # Quantized layers the inputs never called (their parent reads `.weight`, as Mamba's fused
    # path reads dt_proj's): quantized all the same, with no output to compare.
    not_called: tuple[str, ...] = ()

    @property
    def headline(self) -> str:
        """The format; with the share of parameters quantized when a large module is left out."""
        text = f"{self.fmt.name}: {self.fmt.description}"
        if self.params.worth_saying:
            text += (f"; {describe_left_out(self.quantized)} layers, {self.params.percent} of the "
                     f"parameters, quantized; left out: {describe_left_out(self.left_out)}")
        return text

    @property
    def quantized(self) -> tuple[tuple[str, int], ...]:
        """Layers quantized, counted by type: (('Conv1D', 8), ('Linear', 1))."""
        kinds = [e.kind for e in self.layers]
        return tuple((k, kinds.count(k)) for k in dict.fromkeys(sorted(kinds, key=lambda k: (
            list(CONVERTIBLE).index(k) if k in CONVERTIBLE else len(CONVERTIBLE), k))))

    @property
    def int8(self) -> bool:
        """An int8 mode measured on a batch: the table shows which features went the fp16 path."""
        return any(e.outlier_features is not None for e in self.layers)

    @property
    def quantized_bytes(self) -> float:
        return sum(e.bits_per_param * math.prod(e.shape) for e in self.layers) / 8

    @property
    def fp32_bytes(self) -> int:
        return sum(4 * math.prod(e.shape) for e in self.layers)

    def table(self) -> Table:
        rows = [(e.name, e.kind, "×".join(map(str, e.shape)), f"{e.bits_per_param:.3f}",
                 "-" if math.isnan(e.weight_sqnr_db) else f"{e.weight_sqnr_db:.1f}",
                 "-" if math.isnan(e.max_abs_error) else f"{e.max_abs_error:.3g}",
                 "-" if e.output_sqnr_db is None else f"{e.output_sqnr_db:.1f}",
                 *((_features(e.outlier_features),) if self.int8 else ()))
                for e in self.layers]
        notes = [f"{describe_left_out(self.quantized)} weights: "
                 f"{format_bytes(self.quantized_bytes)} in {self.fmt.name} vs "
                 f"{format_bytes(self.fp32_bytes)} in fp32 "
                 f"({self.fp32_bytes / self.quantized_bytes:.2f}× smaller)"]
        notes.append(f"compute dtype {dtype_name(self.dtype)}; "
                     + ("bitsandbytes' layers (CUDA)" if self.real else "emulated bitsandbytes layers"))
        if self.already:
            notes.append(f"the model already held low-bit layers: none replaced as {self.fmt.name} "
                         f"(Lightning's rule); bits/param are the layers' own")
        notes += left_out_notes(self.left_out, "kept as they were")
        if self.not_called:
            notes.append(f"not called on the inputs: {', '.join(self.not_called)} (their weight is "
                         "read directly; quantized all the same, no output SQNR)")
        if self.int8:
            notes.append(f"fp16 features: inputs with |x| >= {THRESHOLD:g} in the batch (LLM.int8())")
        return Table(("layer", "type", "weight (out×in)", "bits/param", "weight SQNR dB",
                      "max |error|", "output SQNR dB", *(("fp16 features",) if self.int8 else ())), rows,
                     caption=self.headline, notes=tuple(notes))


def _layer_outputs(model: nn.Module, inputs: Any, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Output of every Linear / Conv1D layer (or those named) for one eval-mode forward (model,
    RNG and torch's fast-path setting left as they were)."""
    outs: dict[str, torch.Tensor] = {}

    # Eval mode: dropout would draw different masks for the two models compared, and
    # BatchNorm in train mode would update the user's running statistics.
    def register() -> tuple[list[Any], list[tuple[nn.Module, bool]]]:
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        return [m.register_forward_hook(lambda _m, _i, o, n=name: outs.__setitem__(n, o.detach()))
                for name, m in model.named_modules()
                if (kind_of(m) is not None if names is None else name in names)], modes

    def restore(state: tuple[list[Any], list[tuple[nn.Module, bool]]]) -> None:
        handles, modes = state
        for h in handles:
            h.remove()
        for m, training in modes:
            m.training = training

    # Each forward from the caller's RNG state, put back after it: the original and the quantized
    # model draw the same numbers (a VAE's sample in eval mode) and the caller's draws are not
    # spent. torch's fast path is off: its NestedTensors reach no hook or replaced layer.
    with rng_kept(), fastpath_off(), Guard(register, restore), torch.no_grad():
        run_inputs(model, inputs)
    return outs


def _features(cols: tuple[int, ...] | None) -> str:
    if cols is None:
        return "-"
    shown = ", ".join(map(str, cols[:6])) + (" …" if len(cols) > 6 else "")
    return f"{len(cols)}" + (f": {shown}" if cols else "")


def _outliers(layer: nn.Module) -> tuple[int, ...] | None:
    """The input features the latest forward sent to fp16 (emulated or bitsandbytes' Linear8bitLt)."""
    if isinstance(layer, Linear8bitLt):
        return layer.outlier_features
    idx = getattr(getattr(layer, "state", None), "idx", None)  # bitsandbytes' MatmulLtState
    return None if idx is None else tuple(idx.tolist())


def _bitsandbytes_ready(model: nn.Module) -> Any:
    """bitsandbytes' module when it imports and the model is on CUDA, else None (the emulation runs)."""
    p = next(model.parameters(), None)
    if p is None or not p.is_cuda:
        return None
    try:
        import bitsandbytes
    except ImportError:
        return None
    return bitsandbytes


def _is_lowbit(m: nn.Module) -> bool:
    """An emulated layer, or bitsandbytes' own (recognised by class name, never imported for it)."""
    return isinstance(m, LOWBIT_LAYERS) or any(
        c.__name__ in ("Linear4bit", "Linear8bitLt") and c.__module__.startswith("bitsandbytes")
        for c in type(m).__mro__)


def default_dtype(mode: LowBitFormat) -> torch.dtype:
    """Lightning's default compute dtype: float16 for int8 modes, bfloat16 for 4-bit ones."""
    return torch.float16 if mode.quant_type == "int8" else torch.bfloat16


def _check_dtype(f: LowBitFormat, dtype: torch.dtype | None) -> torch.dtype:
    dtype = default_dtype(f) if dtype is None else dtype
    allowed = (torch.float16,) if f.quant_type == "int8" else (torch.bfloat16, torch.float16, torch.float32)
    if dtype not in allowed:  # Lightning: int8 "only works with `dtype=torch.float16`"
        raise ValueError(f"dtype={dtype} is not allowed for {f.name!r}; allowed: "
                         f"{', '.join(map(str, allowed))}")
    return dtype


def _replacement(m: nn.Module, w: torch.Tensor, f: LowBitFormat, dtype: torch.dtype,
                 transposed: bool, bnb: Any) -> nn.Module:
    bias = m.bias
    if bnb is not None:  # the real layers: Lightning's `_quantize_weight` on CUDA
        return _bnb_layer(bnb, w, bias, f, dtype)
    if f.is_4bit:
        return Linear4bit(w, bias, f, dtype, transposed)
    return Linear8bitLt(w, bias, f, transposed=transposed)


def _bnb_layer(bnb: Any, w: torch.Tensor, bias: torch.Tensor | None, f: LowBitFormat,
               dtype: torch.dtype) -> nn.Module:
    out_f, in_f = w.shape
    if f.is_4bit:
        layer = bnb.nn.Linear4bit(in_f, out_f, bias=bias is not None, compute_dtype=dtype,
                                  compress_statistics=f.double_quant, quant_type=f.quant_type,
                                  device="cpu")
        layer.weight = bnb.nn.Params4bit(w.detach().half().cpu(), requires_grad=False,
                                         compress_statistics=f.double_quant, quant_type=f.quant_type)
    else:
        fp16 = f.weight_bits == 16
        layer = bnb.nn.Linear8bitLt(in_f, out_f, bias=bias is not None, has_fp16_weights=fp16,
                                    threshold=6.0, device="cpu")
        layer.weight = bnb.nn.Int8Params(w.detach().half().cpu(), requires_grad=fp16, has_fp16_weights=fp16)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone().cpu(), bias.requires_grad)
    return layer.to(w.device)  # moving to CUDA quantizes the weight


def _effective(layer: nn.Module, f: LowBitFormat) -> torch.Tensor:
    """The (out, in) weight a replaced layer computes with, in fp32 (emulated or bitsandbytes')."""
    if isinstance(layer, LOWBIT_LAYERS):
        return layer.linear_weight().float()
    import bitsandbytes.functional as bnbf  # a real layer: only built when bitsandbytes imports

    if f.is_4bit:
        return bnbf.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    w = layer.weight
    if w.dtype == torch.int8:  # int8: CB with one fp32 scale per row (SCB)
        return w.data.float() * w.SCB.float()[:, None] * INV_127
    return quantize_weight(w.detach().half(), f).dequantize().float()  # int8-training: per forward


def _check_ignore(ignore_modules: Any) -> tuple[str, ...]:
    """The name prefixes to leave alone (ValueError: not a collection of strings)."""
    ignore = tuple(ignore_modules) if isinstance(ignore_modules, Iterable) and not isinstance(
        ignore_modules, str) else None
    if ignore is None or not all(isinstance(p, str) for p in ignore):
        hint = f", e.g. {{{ignore_modules!r}}}" if isinstance(ignore_modules, str) else \
            ", e.g. {'lm_head'}"
        raise ValueError(f"ignore_modules={ignore_modules!r} is not allowed; allowed: a set of "
                         f"module name prefixes{hint}")
    return ignore


def _quantize_bare(model: nn.Module, f: LowBitFormat, dtype: torch.dtype, ignore: tuple[str, ...],
                   inplace: bool, inputs: Any, use_bitsandbytes: bool
                   ) -> tuple[nn.Module, LowBitReport]:
    """A bare layer quantized as the one child of a holder (the caller holds the layer)."""
    if inplace:
        raise ValueError(f"inplace=True cannot replace a bare {type(model).__name__} that the "
                         "caller holds; allowed: inplace=False (the quantized layer is "
                         "returned) or a model containing the layer")
    holder, report = quantize_model(nn.Sequential(model), f, dtype=dtype, ignore_modules=ignore,
                                    inputs=inputs, use_bitsandbytes=use_bitsandbytes)
    layers = tuple(dataclasses.replace(e, name="(model)") for e in report.layers)
    return holder[0], dataclasses.replace(report, layers=layers)


def quantize_model(model: nn.Module, mode: str | LowBitFormat, *, dtype: torch.dtype | None = None,
                   ignore_modules: Iterable[str] = (), inplace: bool = False, inputs: Any = None,
                   use_bitsandbytes: bool = True) -> tuple[nn.Module, LowBitReport]:
    """Replace Linear / Conv1D layers with bitsandbytes layers; returns `(model, report)`.

    As Lightning's `BitsandbytesPrecision`. `mode`: nf4, nf4-dq, fp4, fp4-dq, int8,
    int8-training. `dtype`: the compute dtype (default bfloat16; int8 modes need float16, as in
    Lightning). `ignore_modules`: name prefixes whose layers stay as they are (e.g. {"lm_head"}).
    `inplace=False` (default) works on a deep copy and leaves `model` as it was; `inplace=True`
    replaces the layers of `model` itself. `use_bitsandbytes=True` (default) takes bitsandbytes'
    own layers when the package imports and the model is on CUDA, the emulation otherwise;
    False always emulates. With `inputs` (a batch), each layer's output is compared with the
    original model's (output SQNR; "-" for a layer the batch never calls). A model that already
    holds low-bit layers is not replaced again; only the 4-bit layers' compute dtype is set.
    Each layer using a tied weight gets its own copy. The report (`LowBitReport`) gives each
    layer's bits per parameter and error, and what was left out.
    """
    f = get_lowbit(mode)
    if not isinstance(model, nn.Module):
        raise ValueError(f"quantize_model needs an nn.Module, got {type(model).__name__}")
    dtype = _check_dtype(f, dtype)
    ignore = _check_ignore(ignore_modules)
    bnb = _bitsandbytes_ready(model) if use_bitsandbytes else None
    if any(_is_lowbit(m) for m in model.modules()):
        return _already(model, f, dtype, inplace)
    if kind_of(model) is not None:  # a bare layer: quantized as the one child of a holder
        return _quantize_bare(model, f, dtype, ignore, inplace, inputs, use_bitsandbytes)
    target = model if inplace else copy.deepcopy(model)
    before = _layer_outputs(model, inputs) if inputs is not None and not inplace else None
    swaps, errors, taken = [], [], []
    for name, m in target.named_modules():
        kind = kind_of(m)
        if kind is None or any(name.startswith(p) for p in ignore):
            continue
        taken.append(m)
        w = kind.linear_weight(m).detach()
        new = _replacement(m, w, f, dtype, kind.transposed, bnb)
        parent, _, child = name.rpartition(".")
        swaps.append((target.get_submodule(parent), child, new))
        q = _effective(new, f)
        errors.append((name, tuple(w.shape), f.bits_per_param(w.shape), sqnr(w, q),
                       (w.float() - q).abs().max().item(), kind.name))
    rest = left_out(target, taken)
    share = parameter_share(target, taken, [m.weight for m in taken])
    if not errors:
        why = f" (it has {describe_left_out(rest)})" if rest else ""
        skipped = f" outside ignore_modules={set(ignore)}" if ignore else ""
        raise ValueError(f"{type(model).__name__} has no {' or '.join(CONVERTIBLE)} layers{skipped} to "
                         f"quantize{why}")
    swap_children(swaps)  # all or none, also on an interrupt
    after = _layer_outputs(target, inputs, {e[0] for e in errors}) if before is not None else None
    # A layer the forward never called has no output, here or in the original.
    called = set() if after is None else set(before) & set(after)
    layers = tuple(LayerError(name, shape, bits, w_db, err,
                              sqnr(before[name], after[name]) if name in called else None, kind,
                              _outliers(target.get_submodule(name)) if name in called else None)
                   for name, shape, bits, w_db, err, kind in errors)
    missed = () if after is None else tuple(e[0] for e in errors if e[0] not in called)
    return target, LowBitReport(f, layers, rest, dtype=dtype, real=bnb is not None, params=share,
                                not_called=missed)


def _already(model: nn.Module, f: LowBitFormat, dtype: torch.dtype, inplace: bool
             ) -> tuple[nn.Module, LowBitReport]:
    """Lightning's rule: a converted model keeps its layers; 4-bit layers get the compute dtype."""
    target = model if inplace else copy.deepcopy(model)
    with deferred():
        for m in target.modules():
            if hasattr(m, "compute_dtype") and _is_lowbit(m):
                m.compute_dtype = dtype
    layers = tuple(LayerError(n, (m.out_features, m.in_features),
                              m.fmt.bits_per_param((m.out_features, m.in_features)) if hasattr(m, "fmt")
                              else float("nan"), float("nan"), float("nan"), None, type(m).__name__)
                   for n, m in target.named_modules() if _is_lowbit(m))
    lowbit = [m for m in target.modules() if _is_lowbit(m)]
    # Their weights are stored quantized (codes, bitsandbytes' packed Params): counted as (out, in).
    stored = [p for m in lowbit for n, p in m.named_parameters(recurse=False) if n != "bias"]
    share = parameter_share(target, lowbit, [], exclude=stored)
    share = dataclasses.replace(share, converted=sum(math.prod(e.shape) for e in layers),
                                total=share.total + sum(math.prod(e.shape) for e in layers))
    return target, LowBitReport(f, layers, left_out(target, lowbit), dtype=dtype, already=True,
                                params=share)
