"""What each data reader reads, and how long a resume takes to its first step (issue 48).

    PYTHONPATH=src:tests python tests/data_readers_bench.py [--steps 50 400] [--out FILE]

1. 2 ranks x 2 DataLoader workers (the worker ids as torch gives them) over one JSON lines file:
   the documents each reader parses from the source and the seconds it takes to list them.
2. `tidar-convert fit` on a tiny model for N steps (a checkpoint at N), then resumed from it: the
   seconds from the resumed fit's start to its first training step, at each N; and the same for a
   loader alone (no model), resumed after many more chunks.
Runs on whichever tidar_convert PYTHONPATH names (an older checkout's src/ gives the figures before
a change). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

RECIPE = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")


def corpus(folder: Path, docs: int) -> Path:
    path = folder / "corpus.jsonl"
    with path.open("w") as f:
        for i in range(docs):
            text = f"def f_{i}(x):\n" + "".join(
                f"    y{j} = x * {i % 97 + j} + {j}\n" for j in range(i % 9 + 3)
            )
            f.write(json.dumps({"text": text}) + "\n")
    return path


def reader_shares(path: Path, tokenizer) -> dict:
    """{reader: [documents parsed from the source, seconds]} for 2 ranks x 2 workers."""
    from tidar_convert.data import stream

    parsed = {"n": 0}
    wrapped = "SourceReader" if hasattr(stream, "SourceReader") else "iter_documents"
    real = getattr(stream, wrapped)

    def counting(*a, **k):
        for doc in real(*a, **k):
            parsed["n"] += 1
            yield doc

    setattr(stream, wrapped, counting)
    out, shard = {}, stream.shard
    try:
        for rank in range(2):
            for worker in range(2):
                stream.shard = lambda w=worker: (w, 2)
                ds = stream.PackedDocuments(
                    tokenizer, [str(path)], 64, "train", 20, "text", None, "train", 0, rank, 2
                )
                parsed["n"], t = 0, time.perf_counter()
                kept = sum(1 for _ in ds.documents())
                out[f"rank {rank} worker {worker}"] = {
                    "parsed": parsed["n"],
                    "kept": kept,
                    "seconds": round(time.perf_counter() - t, 3),
                }
    finally:
        setattr(stream, wrapped, real)
        stream.shard = shard
    return out


def fit_resume(tmp: Path, model: Path, data: Path, steps: int) -> float:
    """Seconds from a resumed fit's start to its first training step, after `steps` steps."""
    from tidar_convert.cli import main
    from tidar_convert.train.module import TiDARModule

    run = tmp / f"run{steps}"
    every = tmp / f"every{steps}.yaml"
    every.write_text(
        "trainer:\n  callbacks:\n"
        "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        f"      init_args: {{save_last: true, save_top_k: 0, every_n_train_steps: {steps}}}\n"
    )

    def args(max_steps, *extra):
        return [
            "fit", "--config", RECIPE, "--config", str(every), "--model.model", str(model),
            "--data.source", str(data), "--trainer.default_root_dir", str(run),
            "--trainer.logger", "false", "--trainer.max_steps", str(max_steps),
            "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0", *extra,
        ]  # fmt: skip

    main(args(steps))
    first = {}
    original = TiDARModule.training_step

    def timed(module, batch, batch_idx):
        first.setdefault("t", time.perf_counter())
        return original(module, batch, batch_idx)

    TiDARModule.training_step = timed
    try:
        start = time.perf_counter()
        main(args(steps + 1, "--ckpt_path", "last"))
    finally:
        TiDARModule.training_step = original
    return round(first["t"] - start, 2)


def loader_resume(path: Path, tokenizer, batches: int) -> float:
    """Seconds from loading a position `batches` batches into the epoch to the first batch."""
    from tidar_convert.data import PackedDocuments, ResumableLoader

    def loader():
        ds = PackedDocuments(
            tokenizer, [str(path)], 64, "train", 20, "text", None, "train", 0, shuffle_buffer=64
        )
        return ResumableLoader(ds, batch_size=2)

    whole = loader()
    for i, batch in enumerate(whole):
        whole.count(batch)
        if i + 1 == batches:
            break
    state = whole.state_dict()
    resumed = loader()
    start = time.perf_counter()
    resumed.load_state_dict(state)
    next(iter(resumed))
    return round(time.perf_counter() - start, 3)


def main() -> None:
    import torch
    from helpers import tiny_config, tiny_tokenizer
    from transformers import AutoModelForCausalLM

    import tidar_convert

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, nargs="*", default=[50, 500])
    parser.add_argument("--loader-batches", type=int, nargs="+", default=[100, 8000])
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--out")
    a = parser.parse_args()
    tokenizer = tiny_tokenizer()
    tmp = Path(tempfile.mkdtemp())
    data = corpus(tmp, a.docs)
    torch.manual_seed(0)
    model = tmp / "model"
    AutoModelForCausalLM.from_config(tiny_config("qwen2", len(tokenizer))).save_pretrained(model)
    tokenizer.save_pretrained(model)
    result = {
        "code": tidar_convert.__file__,
        "corpus": {"documents": a.docs, "bytes": data.stat().st_size},
        "readers": reader_shares(data, tokenizer),
        "loader resume, seconds to the first batch": {
            n: loader_resume(data, tokenizer, n) for n in a.loader_batches
        },
        "fit resume, seconds to the first step": {
            n: fit_resume(tmp, model, data, n) for n in a.steps
        },
    }
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
