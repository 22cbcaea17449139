"""Run the same work under several precision modes (`compare`), from the same saved start."""

from ampnb.comparison.result import Comparison, Row, errors, kept, leaves
from ampnb.comparison.run import Work, compare

__all__ = ["Comparison", "Row", "Work", "compare", "errors", "kept", "leaves"]
