"""Precision support of accelerators that are not here, from their documented specification.

Pure data (stdlib only): every cell of a spec column is a status, a reason and the sources it
rests on; `hardware.support_table` shows these columns beside the measured ones. Nothing here is
measured, and tests/test_support_spec.py checks the CUDA columns against ampnb's own decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

NATIVE, EMULATED, NO, NA = "native", "emulated", "not supported", "n/a"
STATUSES = (NATIVE, EMULATED, NO, NA)
LABEL = "from the specification, not measured here"


@dataclass(frozen=True)
class Source:
    """A public document and what it says that a cell rests on."""

    url: str
    says: str


@dataclass(frozen=True)
class SpecCell:
    """One mode or format on one accelerator: status, why, and the keys of its sources."""

    status: str
    reason: str
    sources: tuple[str, ...]


@dataclass(frozen=True)
class CudaNeed:
    """What a row needs on an NVIDIA GPU: native from compute capability `since` (None: never
    native in ampnb), `below` under it; `why` says both, citing `sources`."""

    since: tuple[int, int] | None
    below: str
    why: str
    sources: tuple[str, ...]


@dataclass(frozen=True)
class SpecColumn:
    """An accelerator as its documents describe it, one cell per row of the support table."""

    header: str
    cells: dict[str, SpecCell]


SOURCES: dict[str, Source] = {
    "cuda-guide": Source(
        "https://docs.nvidia.com/cuda/cuda-c-programming-guide/index.html#arithmetic-instructions",
        "its throughput table lists 32- and 64-bit floating-point add, multiply and multiply-add "
        "for every compute capability (64-bit at a small fraction of the rate on 8.6 and 8.9)"),
    "nvidia-amp": Source(
        "https://docs.nvidia.com/deeplearning/performance/mixed-precision-training/index.html",
        "Tensor Cores, introduced with Volta, multiply fp16 inputs with fp32 accumulation; "
        "mixed precision with loss scaling runs on them"),
    "cuda-gpus": Source(
        "https://developer.nvidia.com/cuda-gpus",
        "compute capability per GPU: V100 7.0 (Volta), A100 8.0 (Ampere), L4 / L40S / RTX 40 "
        "8.9 (Ada), H100 9.0 (Hopper)"),
    "torch-tf32": Source(
        "https://docs.pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices",
        "TF32 tensor cores exist on Ampere (compute capability 8.0) and later NVIDIA GPUs"),
    "tf-tf32": Source(
        "https://www.tensorflow.org/api_docs/python/tf/config/experimental/enable_tensor_float_32_execution",
        "TensorFloat-32 is only supported on NVIDIA GPUs starting with Ampere; other hardware "
        "uses full float32"),
    "te-matrix": Source(
        "https://nvidia.github.io/TransformerEngine/support_matrix.html",
        "BF16 requires compute capability 8.0 or higher; FP8 (per tensor: DelayedScaling, "
        "Float8CurrentScaling) requires 8.9 or higher: 8.9 Ada yes, 9.0 Hopper yes, 8.0 Ampere "
        "no; NVFP4 only from 10.0 (Blackwell); NVIDIA GPUs only"),
    "torch-bf16": Source(
        "https://docs.pytorch.org/docs/stable/generated/torch.cuda.is_bf16_supported.html",
        "is_bf16_supported(including_emulation=True) is True also below compute capability 8.0, "
        "where bf16 runs without bf16 units"),
    "rocm-fnuz": Source(
        "https://rocm.docs.amd.com/en/latest/reference/precision-support.html",
        "the FNUZ FP8 variants (E4M3FNUZ, E5M2FNUZ) are the FP8 formats of AMD Instinct MI300 "
        "(gfx942); NVIDIA's FP8 tensor cores take OCP E4M3/E5M2"),
    "apex": Source(
        "https://github.com/NVIDIA/apex",
        "apex.amp is deprecated in favour of PyTorch's native AMP (torch.amp); APEX is a CUDA "
        "extension, and Lightning 2.0 removed amp_backend='apex'"),
    "lightning-1.x-table": Source(
        "https://lightning.ai/docs/pytorch/1.6.0/advanced/precision.html",
        "Precision with Accelerators: 16 — GPU yes, TPU no, IPU yes; BFloat16 — TPU yes, "
        "IPU no; 32 — all; 64 — TPU no, IPU no"),
    "lightning-1.x-tpu": Source(
        "https://lightning.ai/docs/pytorch/1.5.4/advanced/mixed_precision.html",
        "on TPUs, precision=16 enables bfloat16, the only supported precision type on TPUs"),
    "lightning-xla": Source(
        "https://lightning.ai/docs/pytorch/stable/api/lightning.pytorch.plugins.precision.XLAPrecision.html",
        "XLAPrecision(precision) takes '32-true', '16-true' or 'bf16-true'; any other value "
        "raises ValueError"),
    "tpu-bf16": Source(
        "https://cloud.google.com/tpu/docs/bfloat16",
        "by default TPUs multiply in bfloat16 and accumulate in IEEE float32"),
    "tpu-mxu": Source(
        "https://cloud.google.com/tpu/docs/system-architecture-tpu-vm",
        "all MXU multiplies take bfloat16 inputs; accumulations are in FP32"),
    "lightning-ipu": Source(
        "https://lightning.ai/docs/pytorch/LTS/accelerators/ipu_intermediate.html",
        "precision=16 on IPUs is mixed precision without dynamic loss scaling; with model.half() "
        "it is pure 16-bit training"),
    "lightning-graphcore": Source(
        "https://github.com/Lightning-AI/lightning-Graphcore",
        "IPU support left Lightning 2.x for the separate lightning-graphcore package (archived "
        "in February 2024)"),
}

# ---------------------------------------------------------------- NVIDIA GPUs by capability

CUDA_CAPABILITIES: tuple[tuple[int, int], ...] = ((7, 0), (8, 0), (8, 9), (9, 0))

_ALWAYS = (0, 0)
_FP32 = CudaNeed(_ALWAYS, NO, "fp32 and fp64 units on every compute capability", ("cuda-guide",))
_FP16 = CudaNeed((7, 0), NO, "fp16 tensor cores from compute capability 7.0 (Volta)",
                 ("nvidia-amp", "cuda-gpus"))
_BF16 = CudaNeed((8, 0), EMULATED, "bf16 tensor cores from compute capability 8.0 (Ampere); "
                 "below it torch runs bf16 without bf16 units, slower", ("te-matrix", "torch-bf16"))
_FP8 = CudaNeed((8, 9), EMULATED, "FP8 tensor cores from compute capability 8.9 (Ada; Hopper is "
                "9.0); below it ampnb emulates FP8", ("te-matrix",))
_TE = CudaNeed((8, 9), EMULATED, "real FP8 with Transformer Engine installed, from compute "
               "capability 8.9 (Ada; Hopper is 9.0); elsewhere ampnb emulates it", ("te-matrix",))
_APEX = CudaNeed(None, EMULATED, "APEX is deprecated: ampnb runs its opt levels with native torch "
                 "AMP", ("apex",))

CUDA_NEEDS: dict[str, CudaNeed] = {
    "32-true": _FP32, "16-mixed": _FP16, "bf16-mixed": _BF16, "16-true": _FP16,
    "bf16-true": _BF16, "64-true": _FP32, "transformer-engine": _TE,
    "transformer-engine-float16": _TE,
    **dict.fromkeys(("apex-O0", "apex-O1", "apex-O2", "apex-O3"), _APEX),
    "fp64": _FP32, "fp32": _FP32,
    "tf32": CudaNeed((8, 0), NO, "TF32 tensor cores from compute capability 8.0 (Ampere)",
                     ("torch-tf32",)),
    "fp16": _FP16, "bf16": _BF16, "fp8_e4m3": _FP8, "fp8_e5m2": _FP8,
    **dict.fromkeys(("fp8_e4m3fnuz", "fp8_e5m2fnuz"), CudaNeed(
        None, EMULATED, "FNUZ FP8 is AMD MI300's; NVIDIA FP8 tensor cores take E4M3/E5M2, so "
        "ampnb emulates FNUZ", ("rocm-fnuz",))),
    "fp4_e2m1": CudaNeed(None, NO, "FP4 tensor cores arrive with Blackwell (10.0); torch has no "
                         "fp4 dtype here (ampnb.quantize emulates its values)", ("te-matrix",)),
}


def cuda_cell(row: str, capability: tuple[int, int]) -> SpecCell:
    """The spec cell of a mode or format on an NVIDIA GPU of this compute capability."""
    need = CUDA_NEEDS[row]
    native = need.since is not None and tuple(capability) >= need.since
    return SpecCell(NATIVE if native else need.below, need.why, need.sources)


# ---------------------------------------------------------------- TPU and IPU

_XLA_ONLY = ("lightning-xla",)
_NOT_NVIDIA = {
    "transformer-engine": SpecCell(NO, "Transformer Engine runs on NVIDIA GPUs only", ("te-matrix",)),
    "apex": SpecCell(NO, "APEX is a CUDA extension", ("apex",)),
}
_TF32_NA = SpecCell(NA, "TF32 is a mode of NVIDIA tensor cores; other hardware computes float32",
                    ("tf-tf32",))


def _nvidia_only(cells: dict[str, SpecCell]) -> dict[str, SpecCell]:
    te, apex = _NOT_NVIDIA["transformer-engine"], _NOT_NVIDIA["apex"]
    return {**cells, "transformer-engine": te, "transformer-engine-float16": te,
            **dict.fromkeys(("apex-O0", "apex-O1", "apex-O2", "apex-O3"), apex)}


_TPU_NO_MIXED = SpecCell(NO, "Lightning's XLAPrecision takes 32-true, 16-true and bf16-true only; "
                         "Lightning 1.x's precision=16 meant bf16 on TPU",
                         ("lightning-xla", "lightning-1.x-tpu"))
_TPU_FP16 = SpecCell(EMULATED, "XLAPrecision takes 16-true, but the matrix units multiply "
                     "bfloat16 inputs: no fp16 multipliers", ("lightning-xla", "tpu-mxu"))
_TPU_BF16 = SpecCell(NATIVE, "bfloat16 is what the matrix units multiply (bf16-true in "
                     "XLAPrecision)", ("tpu-bf16", "lightning-xla"))
_TPU_NO64 = SpecCell(NO, "Lightning's table lists 64-bit as not supported on TPU; XLAPrecision has "
                     "no 64-true", ("lightning-1.x-table", "lightning-xla"))
_TPU_NO8 = SpecCell(NO, "no FP8/FP4 precision in Lightning's XLAPrecision; the matrix units "
                    "multiply bfloat16 inputs", ("lightning-xla", "tpu-mxu"))

TPU = SpecColumn("tpu (spec)", _nvidia_only({
    "32-true": SpecCell(NATIVE, "32-true in Lightning's XLAPrecision", _XLA_ONLY),
    "16-mixed": _TPU_NO_MIXED, "bf16-mixed": _TPU_NO_MIXED, "16-true": _TPU_FP16,
    "bf16-true": _TPU_BF16, "64-true": _TPU_NO64, "fp64": _TPU_NO64,
    "fp32": SpecCell(NATIVE, "TPUs accumulate in float32 and compute float32 elsewhere",
                     ("tpu-bf16",)),
    "tf32": _TF32_NA, "fp16": _TPU_FP16, "bf16": _TPU_BF16,
    **dict.fromkeys(("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz", "fp4_e2m1"), _TPU_NO8),
}))

_IPU_SRC = ("lightning-1.x-table", "lightning-graphcore")
_IPU_16 = SpecCell(NATIVE, "Lightning 1.x: precision=16 on IPU (mixed, no dynamic loss scaling; "
                   "pure 16-bit with model.half())", ("lightning-1.x-table", "lightning-ipu"))
_IPU_32 = SpecCell(NATIVE, "Lightning 1.x: 32 on IPU", _IPU_SRC)
_IPU_NO = SpecCell(NO, "Lightning 1.x's table: BFloat16 and 64 not on IPU", _IPU_SRC)
_IPU_NA = SpecCell(NA, "Lightning's IPU support (16 and 32 only, gone in 2.0) had no FP8/FP4",
                   _IPU_SRC)

IPU = SpecColumn("ipu (spec)", _nvidia_only({
    "32-true": _IPU_32, "16-mixed": _IPU_16, "bf16-mixed": _IPU_NO, "16-true": _IPU_16,
    "bf16-true": _IPU_NO, "64-true": _IPU_NO, "fp64": _IPU_NO, "fp32": _IPU_32, "tf32": _TF32_NA,
    "fp16": _IPU_16, "bf16": _IPU_NO,
    **dict.fromkeys(("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz", "fp4_e2m1"), _IPU_NA),
}))


def spec_columns() -> tuple[SpecColumn, ...]:
    """CUDA 7.0 / 8.0 / 8.9 / 9.0, TPU and IPU, each cell from the documents in SOURCES."""
    cuda = tuple(SpecColumn(f"cuda {major}.{minor} (spec)",
                            {row: cuda_cell(row, (major, minor)) for row in CUDA_NEEDS})
                 for major, minor in CUDA_CAPABILITIES)
    return (*cuda, TPU, IPU)
