"""Devices and what each can do (support), the TF32 switch and setting, measured throughput.

Parts import downwards only: spec (documented support of absent accelerators, pure data)
<- hardware (devices, support, the support table) <- placement (the device the data is on),
tf32_switch <- throughput. The room sits above `ampnb.modes` (support takes a mode); the CPU's
features, which fp16_kernels (below the modes) needs too, live below both in `ampnb.cpu`.
"""

from __future__ import annotations

from ampnb._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("cpu_features", "cpu_features_as"), "ampnb.cpu"),
    **dict.fromkeys(("DeviceInfo", "Support", "devices", "get_device", "support", "support_table",
                     "sync"), "ampnb.device.hardware"),
    **dict.fromkeys(("TF32_ALLOWED", "TF32Setting", "TF32State", "restore_tf32", "set_tf32", "tf32",
                     "tf32_context", "tf32_effect", "tf32_setting", "tf32_state"),
                    "ampnb.device.tf32_switch"),
    **dict.fromkeys(("SOURCES", "spec_columns"), "ampnb.device.spec"),
    **dict.fromkeys(("Placement", "data_devices", "for_ranks", "place", "place_model"), "ampnb.device.placement"),
    **dict.fromkeys(("Throughput", "matmul_throughput", "throughput_table"),
                    "ampnb.device.throughput"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS,
                                             ("hardware", "placement", "spec", "tf32_switch",
                                              "throughput"))
