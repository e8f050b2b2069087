"""Calibration and evaluation text -> seeded, packed [N, L] token blocks."""

from quantkit.data.calibration import CalibrationSet, build_token_blocks, load_documents

__all__ = ["CalibrationSet", "build_token_blocks", "load_documents"]
