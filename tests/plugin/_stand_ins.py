"""The two checks the CPU tests stand in for (see conftest.py), and the real ones."""

from __future__ import annotations

import dsv4_plugin
import dsv4_plugin.attention

REAL_PLATFORM_PROBLEM = dsv4_plugin._platform_problem
REAL_DEVICE_PROBLEM = dsv4_plugin.attention.device_problem


def stand_in_for_cuda() -> None:
    """Make the plugin treat this CPU process as a CUDA platform with dsv4's kernels."""
    dsv4_plugin._platform_problem = lambda: None
    dsv4_plugin.attention.device_problem = lambda: None
