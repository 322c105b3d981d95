"""Debugging and observability: ``TensorChecker``, the mismatch localizer, the timeline (``dt.profile``) and the
roofline report. See ``docs/debugging.md``."""

from __future__ import annotations

from torch_dtorch.tools.checker import CheckReport, CheckResult, TensorChecker, TensorCheckError
from torch_dtorch.tools.localizer import (
    MismatchReport,
    ModuleMismatch,
    OpMismatch,
    localize_mismatch,
    localize_op,
)
from torch_dtorch.tools.recorder import GraphRecorder
from torch_dtorch.tools.roofline import DevicePeaks, RooflineReport, device_peaks, measure_peaks, roofline
from torch_dtorch.tools.trace import Profile, Span, profile

__all__ = [
    "CheckReport",
    "CheckResult",
    "DevicePeaks",
    "GraphRecorder",
    "MismatchReport",
    "ModuleMismatch",
    "OpMismatch",
    "Profile",
    "RooflineReport",
    "Span",
    "TensorCheckError",
    "TensorChecker",
    "device_peaks",
    "localize_mismatch",
    "localize_op",
    "measure_peaks",
    "profile",
    "roofline",
]
