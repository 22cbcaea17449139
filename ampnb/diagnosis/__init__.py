"""The precision doctor: `ampnb.doctor(model, batch)` runs one step in every mode and recommends one.

The package is itself callable: `ampnb.doctor(...)` runs the doctor and `ampnb.doctor.profile_step`
is beside it, whichever way `ampnb.doctor` was reached (the lazy export or `import ampnb.doctor`).
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

from ampnb.doctor import core
from ampnb.doctor.evidence import ModeRow
from ampnb.doctor.layers import LayerRow
from ampnb.doctor.profile import Profile
from ampnb.doctor.recommend import Recommendation, Tolerance
from ampnb.doctor.report import DoctorReport
from ampnb.doctor.why import profile_step

__all__ = ["DoctorReport", "LayerRow", "ModeRow", "Profile", "Recommendation", "Tolerance",
           "doctor", "profile_step"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> DoctorReport:
        return core.doctor(*args, **kwargs)


__signature__ = inspect.signature(core.doctor)
sys.modules[__name__].__class__ = _CallableModule
doctor = sys.modules[__name__]  # the lazy export `ampnb.doctor` resolves to this package
