"""Run the same work under several precision modes (`compare`), from the same saved start."""

from ampnb.comparison.run import Comparison, Row, Work, compare, errors, kept, leaves

__all__ = ["Comparison", "Row", "Work", "compare", "errors", "kept", "leaves"]
