"""Peak host memory (RSS) that building the training model adds to one process
(test_multiprocess.py).

    python -m torch.distributed.run --nproc-per-node 2 tests/rss_worker.py MODEL_DIR OUT sharded
    python -m torch.distributed.run --nproc-per-node 1 tests/rss_worker.py MODEL_DIR OUT single

Builds the model as `fit` does, through TiDARModule.configure_model: sharded, with the FSDP2 device
mesh ModelParallelStrategy would hand it; single, as one process without a strategy. Writes
OUT.<rank>.json with the process's peak RSS before and after, in GiB.
"""

import json
import resource
import sys
from pathlib import Path


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main(model_dir: str, out: str, mode: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tidar_convert.train.module import TiDARModule

    rank = 0
    if mode == "sharded":
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    module = TiDARModule(model=model_dir, draft_length=4)  # config and tokenizer only
    before = peak_gib()
    if mode == "sharded":
        # what ModelParallelStrategy sets
        module._device_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    module.configure_model()
    Path(f"{out}.{rank}.json").write_text(json.dumps({"before": before, "after": peak_gib()}))
    if mode == "sharded":
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
