"""What computes what on this host, decided once: `Platform.for_device(device, config)` probes the CPU
and the C kernels and returns a frozen `PlatformPlan` (dtype, weight packing, attention backend, LoRA
op, fused ops, decode stack, copy engine, huge pages, memory budget) that the model and the runner
receive. Layered above models/ and lora/, below engine/.
"""

from inference_service.platform.plan import PlatformPlan
from inference_service.platform.platform import Platform

__all__ = ["Platform", "PlatformPlan"]
