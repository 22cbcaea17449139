"""The doctor's tolerance: the largest loss and gradient errors a mode may have."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    """Largest relative loss error and relative gradient error (L2, all parameters) accepted."""

    loss: float = 1e-2
    grad: float = 1e-1

    @classmethod
    def of(cls, value: object) -> Tolerance:
        """None (defaults), one number for both, a (loss, grad) pair, a dict or a Tolerance."""
        if value is None:
            return cls()
        if isinstance(value, Tolerance):
            return value
        try:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                found = cls(float(value), float(value))
            elif isinstance(value, dict):
                found = cls(**{k: float(v) for k, v in value.items()})
            else:
                loss, grad = value  # type: ignore[misc]
                found = cls(float(loss), float(grad))
        except (TypeError, ValueError):
            found = None
        if found is None or not (found.loss > 0 and found.grad > 0):
            raise ValueError(f"tolerance={value!r} is not allowed; allowed: a positive number, "
                             "a (loss, grad) pair or {'loss': ..., 'grad': ...}")
        return found
