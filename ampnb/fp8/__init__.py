"""FP8 training: emulated in torch everywhere, Transformer Engine on Hopper (low-bit weights: ampnb.lowbit)."""

from __future__ import annotations

from ampnb._lazy import lazy_exports

# Public name -> module, imported on first use (the Transformer Engine path only when asked).
_EXPORTS: dict[str, str] = {
    "Fp8Recipe": "ampnb.fp8.recipe",
    "Fp8Format": "ampnb.fp8.recipe",
    "Scaling": "ampnb.fp8.recipe",
    "AmaxAlgo": "ampnb.fp8.recipe",
    "DelayedScaling": "ampnb.fp8.recipe",
    "RECIPES": "ampnb.fp8.recipe",
    "from_recipe_name": "ampnb.fp8.recipe",
    "tensor_to_amax": "ampnb.fp8.scaling",
    "amax_to_scale": "ampnb.fp8.scaling",
    "scaled_quantize": "ampnb.fp8.scaling",
    "sqnr": "ampnb.fp8.scaling",
    "Fp8Linear": "ampnb.fp8.linear",
    "MxLinear": "ampnb.fp8.mx",
    "CONVERTIBLE": "ampnb.fp8.layers",
    "Role": "ampnb.fp8.linear",
    "convert_to_fp8": "ampnb.fp8.convert",
    "revert_fp8": "ampnb.fp8.convert",
    "fp8_report": "ampnb.fp8.convert",
    "plan": "ampnb.fp8.convert",
    "Fp8Stats": "ampnb.fp8.stats",
    "fp8_autocast": "ampnb.fp8.autocast",
    "fp8_active": "ampnb.fp8.autocast",
    "te_status": "ampnb.fp8.backends",
    "BACKENDS": "ampnb.fp8.backends",
    # Low-bit weight formats live in ampnb.lowbit; these names stay reachable from here.
    "LOWBIT_FORMATS": "ampnb.lowbit.formats",
    "get_lowbit": "ampnb.lowbit.formats",
    "nf4_codebook": "ampnb.lowbit.formats",
    "quantize_weight": "ampnb.lowbit.formats",
    "roundtrip": "ampnb.lowbit.formats",
    "block_normalized": "ampnb.lowbit.formats",
    "quantize_model": "ampnb.lowbit.model",
    # A runner on the one step, above the modes (which import fp8): it lives in comparison.
    "side_by_side": "ampnb.comparison.fp8",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
