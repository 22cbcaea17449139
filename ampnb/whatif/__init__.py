"""What a training step's tensors would lose in each format, layer by layer (`ampnb.what_if`)."""

from __future__ import annotations

from ampnb.whatif.casts import DEFAULT_FORMATS, get_cast
from ampnb.whatif.result import WhatIf, WhatIfRow
from ampnb.whatif.run import what_if

__all__ = ["DEFAULT_FORMATS", "WhatIf", "WhatIfRow", "get_cast", "what_if"]
