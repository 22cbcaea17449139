"""Weight-only low-bit formats (NF4, NF4 with double quantization, FP4, int8), emulated in torch."""

from __future__ import annotations

from ampnb._lazy import lazy_exports

# Public name -> module, imported on first use.
_EXPORTS: dict[str, str] = {
    "LowBitFormat": "ampnb.lowbit.formats",
    "LOWBIT_FORMATS": "ampnb.lowbit.formats",
    "get_lowbit": "ampnb.lowbit.formats",
    "nf4_codebook": "ampnb.lowbit.formats",
    "fp4_codebook": "ampnb.lowbit.formats",
    "int8_codebook": "ampnb.lowbit.formats",
    "Quantized": "ampnb.lowbit.formats",
    "quantize_weight": "ampnb.lowbit.formats",
    "roundtrip": "ampnb.lowbit.formats",
    "block_normalized": "ampnb.lowbit.formats",
    "quantize_model": "ampnb.lowbit.model",
    "LowBitReport": "ampnb.lowbit.model",
    "LayerError": "ampnb.lowbit.model",
    "sqnr": "ampnb.fp8.scaling",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
