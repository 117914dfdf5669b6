"""What a measurement ran on: versions, device, threads, load, and the model's dtype and size."""

from __future__ import annotations

import os
import platform

import torch


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def machine_info(device: torch.device, model=None) -> dict:
    import transformers

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        # Other processes on the CPU wreck timings (torch's threads spin against them): check this
        # is near 0 before trusting a CPU number.
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
    }
    if model is not None:
        info["dtype"] = str(model.dtype)
        info["attn_implementation"] = model.config._attn_implementation
        info["parameters"] = sum(p.numel() for p in model.parameters())
        # generate()'s default product on this machine (kernels.packing_pays)
        if device.type == "cpu":
            from tidar_convert.runtime.kernels import linear_product, packing_pays, product_timings

            info["packed_linears"] = packing_pays(model)
            info["linear_product"] = linear_product(model)  # "panels", "onednn" or "stock"
            # the passes (ms at 1 and 8 rows, per product) that choice compared
            info["product_timings"] = product_timings(model)
    return info
