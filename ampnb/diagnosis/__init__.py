"""The precision doctor: `ampnb.doctor(model, batch)` runs one step in every mode and recommends one.

`ampnb.doctor` is the function `core.doctor`; `profile_step` rides on it as an attribute, so
`ampnb.diagnosis.profile_step(...)` works. The package is named `diagnosis` (as `ampnb.comparison`
is beside `ampnb.compare`) so that `ampnb.doctor` stays the function.
"""

from __future__ import annotations

from ampnb.diagnosis.core import doctor
from ampnb.diagnosis.evidence import ModeRow
from ampnb.diagnosis.layers import LayerRow
from ampnb.diagnosis.profile import Profile
from ampnb.diagnosis.recommend import Recommendation, Tolerance
from ampnb.diagnosis.replay import Replay, replay
from ampnb.diagnosis.report import DoctorReport
from ampnb.diagnosis.why import profile_step

__all__ = ["DoctorReport", "LayerRow", "ModeRow", "Profile", "Recommendation", "Replay",
           "Tolerance", "doctor", "profile_step", "replay"]
