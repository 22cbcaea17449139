"""bitsandbytes in torch: Lightning's six weight modes (nf4, nf4-dq, fp4, fp4-dq, int8, int8-training), 8-bit Adam."""

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
    "double_quant_saving": "ampnb.lowbit.formats",
    "dynamic_map": "ampnb.lowbit.blockwise",
    "quantize_blockwise": "ampnb.lowbit.blockwise",
    "dequantize_blockwise": "ampnb.lowbit.blockwise",
    "int8_vectorwise_quant": "ampnb.lowbit.int8",
    "int8_split": "ampnb.lowbit.int8",
    "Int8Split": "ampnb.lowbit.int8",
    "Linear4bit": "ampnb.lowbit.layers",
    "Linear8bitLt": "ampnb.lowbit.layers",
    "Adam8bit": "ampnb.lowbit.optim",
    "param_groups": "ampnb.lowbit.optim",
    "compare_optimizers": "ampnb.lowbit.optim_compare",
    "OptimizerComparison": "ampnb.lowbit.optim_compare",
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
