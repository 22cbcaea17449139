"""TF32 flags, legacy and new, read and restored exactly (used through ampnb.device)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# torch >= 2.9 keeps two sets of books: the legacy fields (float32 matmul precision, cuDNN's
# allow_tf32) and per-(backend, op) `fp32_precision` strings. Its getters raise once the two
# disagree, so every write below keeps them in step and restore puts back both, raw.

_FP32_PAIRS = (("generic", "all"), ("cuda", "all"), ("mkldnn", "all"), ("cuda", "matmul"),
               ("cuda", "conv"), ("cuda", "rnn"), ("mkldnn", "matmul"), ("mkldnn", "conv"),
               ("mkldnn", "rnn"))  # "all" first: setting it overwrites that backend's ops
_get_raw = getattr(torch._C, "_get_fp32_precision_getter", None)
_set_raw = getattr(torch._C, "_set_fp32_precision_setter", None)


@dataclass(frozen=True)
class TF32State:
    """Every TF32-related torch flag, legacy and new, exactly as stored."""

    matmul_precision: str                          # torch.get_float32_matmul_precision()
    cudnn_allow_tf32: bool                         # torch.backends.cudnn.allow_tf32
    fp32_precision: tuple[tuple[str, str, str], ...] = ()  # (backend, op, value), torch >= 2.9

    @property
    def matmul(self) -> bool:
        """Whether CUDA fp32 matmuls may use TF32."""
        raw = {(b, o): v for b, o, v in self.fp32_precision}
        for key in (("cuda", "matmul"), ("cuda", "all"), ("generic", "all")):
            if raw.get(key, "none") != "none":
                return raw[key] == "tf32"
        return self.matmul_precision != "highest"


def _raw_pairs() -> tuple[tuple[str, str, str], ...]:
    if _get_raw is None:
        return ()
    found = []
    for backend, op in _FP32_PAIRS:
        with contextlib.suppress(RuntimeError):  # a pair this torch does not know
            found.append((backend, op, _get_raw(backend, op)))
    return tuple(found)


@contextlib.contextmanager
def _raw_set(values: dict[tuple[str, str], str]) -> Iterator[None]:
    """Set some fp32_precision pairs for a moment, to read a legacy field past torch's check."""
    saved = {k: _get_raw(*k) for k in values}
    try:
        for k, v in values.items():
            _set_raw(*k, v)
        yield
    finally:
        for k, v in saved.items():
            _set_raw(*k, v)


def _legacy_matmul_precision() -> str:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:  # mixed APIs: neutral matmul entries make torch's consistency check pass
        with _raw_set({("cuda", "matmul"): "ieee", ("mkldnn", "matmul"): "ieee"}):
            return torch.get_float32_matmul_precision()


def _legacy_cudnn_tf32() -> bool:
    try:
        return bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:  # the check passes with conv = rnn = tf32 exactly when the field is True
        with _raw_set({("cuda", "conv"): "tf32", ("cuda", "rnn"): "tf32"}):
            try:
                return bool(torch.backends.cudnn.allow_tf32)
            except RuntimeError:
                return False


def tf32_state() -> TF32State:
    """Read every TF32 flag without changing any."""
    return TF32State(_legacy_matmul_precision(), _legacy_cudnn_tf32(), _raw_pairs())


def restore_tf32(state: TF32State) -> None:
    """Put every TF32 flag back exactly as `state` recorded it."""
    if not isinstance(state, TF32State):
        raise ValueError(f"restore_tf32 needs a TF32State (from tf32_state or set_tf32), got {state!r}")
    # The legacy setters also write fp32_precision entries, so the raw entries go last.
    torch.set_float32_matmul_precision(state.matmul_precision)
    torch.backends.cudnn.allow_tf32 = state.cudnn_allow_tf32
    for backend, op, value in state.fp32_precision:
        _set_raw(backend, op, value)


def set_tf32(enabled: bool) -> TF32State:
    """Allow (or forbid) TF32 in CUDA fp32 matmuls and cuDNN convolutions; return the old state."""
    if not isinstance(enabled, bool):
        raise ValueError(f"set_tf32 takes True or False, got {enabled!r}")
    previous = tf32_state()
    try:
        if enabled:
            if previous.matmul_precision == "highest":
                torch.backends.cuda.matmul.allow_tf32 = True  # -> "high" on CUDA only
            if _set_raw is not None:
                _set_raw("cuda", "matmul", "tf32")
        else:
            torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = enabled
        if _set_raw is not None:  # explicit, so a backend-wide "all" entry cannot override it
            for op in ("conv", "rnn"):
                _set_raw("cuda", op, "tf32" if enabled else "ieee")
    except BaseException:
        restore_tf32(previous)
        raise
    return previous


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[TF32State]:
    """TF32 on or off for the body; every flag is restored afterwards, also on error."""
    previous = set_tf32(enabled)
    try:
        yield tf32_state()
    finally:
        restore_tf32(previous)
