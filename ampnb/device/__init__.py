"""Devices and what each can do (support), the TF32 switch and setting, measured throughput.

Parts import downwards only: cpu <- hardware (devices, support) <- tf32_switch <- throughput.
"""

from __future__ import annotations

from ampnb.device.cpu import cpu_features, cpu_features_as
from ampnb.device.hardware import (
    DeviceInfo,
    Support,
    devices,
    get_device,
    support,
    support_table,
    sync,
)
from ampnb.device.tf32_switch import (
    TF32_ALLOWED,
    TF32Setting,
    TF32State,
    restore_tf32,
    set_tf32,
    tf32,
    tf32_context,
    tf32_effect,
    tf32_setting,
    tf32_state,
)
from ampnb.device.throughput import Throughput, matmul_throughput, throughput_table

__all__ = ["TF32_ALLOWED", "DeviceInfo", "Support", "TF32Setting", "TF32State", "Throughput", "cpu_features",
           "cpu_features_as", "devices", "get_device", "matmul_throughput", "restore_tf32",
           "set_tf32", "support", "support_table", "sync", "tf32", "tf32_context", "tf32_effect",
           "tf32_setting", "tf32_state", "throughput_table"]
