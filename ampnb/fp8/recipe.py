"""FP8 recipes as frozen data: Transformer Engine's DelayedScaling and torchao's tensorwise."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any

from ampnb.formats import FloatFormat, get_format


class Fp8Format(str, Enum):
    """Which FP8 format each pass uses (Transformer Engine's `recipe.Format`)."""

    HYBRID = "HYBRID"  # e4m3 forward (inputs, weights), e5m2 backward (output gradients)
    E4M3 = "E4M3"      # e4m3 everywhere


class Scaling(str, Enum):
    """Where a tensor's scale comes from."""

    DELAYED = "delayed"  # from the amax history of earlier steps (Transformer Engine)
    DYNAMIC = "dynamic"  # from the tensor itself, just before the cast (torchao tensorwise)


class AmaxAlgo(str, Enum):
    """How the amax history becomes one amax (Transformer Engine's `amax_compute_algo`)."""

    MAX = "max"
    MOST_RECENT = "most_recent"


def _enum(cls: type[Enum], value: Any, field_name: str) -> Enum:
    try:
        return cls(value.upper() if cls is Fp8Format and isinstance(value, str) else value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{field_name}={value!r} is not allowed; allowed: {allowed}") from None


@dataclass(frozen=True)
class Fp8Recipe:
    """Per-tensor FP8 scaling: formats, scale source, amax window and margin.

    Defaults are Transformer Engine's `DelayedScaling()`; `saturate=True` clamps values past
    the format's max (what TE's and torchao's casts do), False keeps torch's cast behaviour.
    """

    fp8_format: Fp8Format = Fp8Format.HYBRID
    scaling: Scaling = Scaling.DELAYED
    amax_history_len: int = 1024
    amax_compute_algo: AmaxAlgo = AmaxAlgo.MAX
    margin: int = 0
    saturate: bool = True

    def __post_init__(self) -> None:
        for name, cls in (("fp8_format", Fp8Format), ("scaling", Scaling),
                          ("amax_compute_algo", AmaxAlgo)):
            object.__setattr__(self, name, _enum(cls, getattr(self, name), name))
        n = self.amax_history_len
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"amax_history_len={n!r} is not allowed; allowed: an integer >= 1")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin={self.margin!r} is not allowed; allowed: an integer >= 0")
        if not isinstance(self.saturate, bool):
            raise ValueError(f"saturate={self.saturate!r} is not allowed; allowed: True or False")

    @property
    def forward_format(self) -> FloatFormat:
        """Format of inputs and weights."""
        return get_format("fp8_e4m3")

    @property
    def backward_format(self) -> FloatFormat:
        """Format of the output gradients."""
        return get_format("fp8_e5m2" if self.fp8_format is Fp8Format.HYBRID else "fp8_e4m3")

    @property
    def history_len(self) -> int:
        """Amax values kept: dynamic scaling only ever looks at the current tensor."""
        return 1 if self.scaling is Scaling.DYNAMIC else self.amax_history_len

    def describe(self) -> str:
        """One line for tables and plot titles."""
        if self.scaling is Scaling.DYNAMIC:
            how = "dynamic (scale from the current tensor)"
        else:
            how = (f"delayed, amax = {self.amax_compute_algo.value} of the last "
                   f"{self.amax_history_len} steps")
        return (f"{self.fp8_format.value}: fwd {self.forward_format.name}, bwd "
                f"{self.backward_format.name}; {how}; margin {self.margin}")

    def replace(self, **changes: Any) -> Fp8Recipe:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


def DelayedScaling(*, fp8_format: Fp8Format | str = Fp8Format.HYBRID,  # noqa: N802 - TE's name
                   amax_history_len: int = 1024, amax_compute_algo: AmaxAlgo | str = AmaxAlgo.MAX,
                   margin: int = 0, saturate: bool = True, **unknown: Any) -> Fp8Recipe:
    """Transformer Engine's delayed-scaling recipe (same field names and defaults)."""
    if unknown:  # a misspelt field: one line naming those allowed, not Python's TypeError
        allowed = sorted(f.name for f in fields(Fp8Recipe) if f.name != "scaling")
        raise ValueError(f"DelayedScaling has no field {sorted(unknown)[0]!r}; allowed: "
                         f"{', '.join(allowed)}")
    return Fp8Recipe(fp8_format=fp8_format, scaling=Scaling.DELAYED,
                     amax_history_len=amax_history_len, amax_compute_algo=amax_compute_algo,
                     margin=margin, saturate=saturate)


# torchao's float8 recipe names -> recipes. Only per-tensor scaling is emulated here.
RECIPES: dict[str, Fp8Recipe] = {
    "delayed": Fp8Recipe(),
    "tensorwise": Fp8Recipe(scaling=Scaling.DYNAMIC),
    "dynamic": Fp8Recipe(scaling=Scaling.DYNAMIC),
    "e4m3-delayed": Fp8Recipe(fp8_format=Fp8Format.E4M3),
    "e4m3-dynamic": Fp8Recipe(fp8_format=Fp8Format.E4M3, scaling=Scaling.DYNAMIC),
}


def from_recipe_name(name: str | Fp8Recipe | None) -> Fp8Recipe:
    """Turn a recipe name (or a recipe, or None for TE's default) into an `Fp8Recipe`."""
    if name is None:
        return RECIPES["delayed"]
    if isinstance(name, Fp8Recipe):
        return name
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {name!r}; allowed: {', '.join(RECIPES)}")
    return RECIPES[key]


# Transformer Engine DelayedScaling fields ampnb emulates, and those it accepts only at the value
# that changes nothing here (reduce_amax: any bool, one device has no amax to reduce).
TE_FIELDS = ("margin", "fp8_format", "amax_history_len", "amax_compute_algo")
TE_INERT: dict[str, Any] = {"interval": 1, "override_linear_precision": (False, False, False),
                            "scaling_factor_compute_algo": None, "fp8_dpa": False,
                            "fp8_mha": False, "backward_override": None}


def _te_fields(recipe: Any) -> dict[str, Any]:
    if isinstance(recipe, Mapping):
        return dict(recipe)
    if type(recipe).__name__ == "DelayedScaling":  # Transformer Engine's own recipe object
        names = (*TE_FIELDS, *TE_INERT, "reduce_amax")
        return {n: getattr(recipe, n) for n in names if hasattr(recipe, n)}
    raise ValueError(f"recipe={recipe!r} is not allowed; allowed: None, a dict of DelayedScaling's "
                     "fields, a transformer_engine DelayedScaling or an ampnb Fp8Recipe")


def from_te_recipe(recipe: Any) -> Fp8Recipe:
    """Lightning's `TransformerEnginePrecision(recipe=...)`: a dict of DelayedScaling's fields
    (fp8_format by its Format name, as Lightning reads it), a TE DelayedScaling, or None."""
    if recipe is None or isinstance(recipe, Fp8Recipe):
        return from_recipe_name(recipe)
    given = _te_fields(recipe)
    allowed = (*TE_FIELDS, *TE_INERT, "reduce_amax")
    for key, value in given.items():
        if key not in allowed:
            raise ValueError(f"DelayedScaling has no field {key!r}; allowed: {', '.join(allowed)}")
        if key in TE_INERT and value != TE_INERT[key] and not (key == "override_linear_precision"
                                                               and tuple(value) == TE_INERT[key]):
            raise ValueError(f"{key}={value!r} is not emulated by ampnb; allowed: "
                             f"{TE_INERT[key]!r} (Transformer Engine's default)")
    fmt = given.get("fp8_format", Fp8Format.HYBRID)
    fmt = getattr(fmt, "name", fmt)  # TE's Format enum, by name
    if isinstance(fmt, str) and fmt.upper() == "E5M2":
        raise ValueError("fp8_format='E5M2' is not allowed; allowed: 'HYBRID', 'E4M3' "
                         "(Transformer Engine's DelayedScaling refuses pure E5M2 training)")
    if callable(given.get("amax_compute_algo")):
        raise ValueError("a callable amax_compute_algo is not emulated by ampnb; allowed: "
                         "'max', 'most_recent'")
    kept = {k: v for k, v in given.items() if k in TE_FIELDS and k != "fp8_format"}
    return Fp8Recipe(fp8_format=fmt, scaling=Scaling.DELAYED, **kept)
