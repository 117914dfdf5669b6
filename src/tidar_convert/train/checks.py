"""What `fit` and `validate` check before anything is instantiated: the settings' own arithmetic
(steps, precision, global batch), --out against the run folder, the data's files, the accelerator,
and the model's config (never its weights)."""

from __future__ import annotations

import sys
from pathlib import Path


def check_fit_config(cfg) -> None:
    """Refuse, before any model is loaded, settings that would train nothing or lose the result."""
    steps = cfg.trainer.get("max_steps")
    if steps == 0 or (steps is not None and steps < -1):
        raise ValueError(
            f"--trainer.max_steps {steps}: trains nothing{'' if steps == 0 else ' (negative)'}; "
            "pass the number of optimizer steps to train (>= 1), "
            "or -1 to stop after --trainer.max_epochs."
        )
    if cfg.get("overwrite") and not cfg.get("out"):
        raise ValueError(
            "--overwrite replaces an earlier export at --out, and no --out is given; "
            "pass --out DIR, or drop --overwrite."
        )
    if cfg.get("out"):
        from tidar_convert.exports.marker import check_export_target

        check_out_beside_run(cfg.out, cfg.trainer.get("default_root_dir") or ".")
        check_export_target(cfg.out, overwrite=bool(cfg.get("overwrite")))
    precision = str(cfg.trainer.get("precision") or "")
    on_cpu = training_on_cpu(cfg.trainer.get("accelerator"))
    if precision.startswith("16") and on_cpu:
        raise ValueError(
            f"--trainer.precision {precision}: float16 mixed precision does not run on a CPU "
            "(Lightning would switch to bf16-mixed without a word); "
            "pass --trainer.precision 32-true, or bf16-mixed where the CPU computes bf16 natively."
        )
    if precision.startswith("bf16") and on_cpu and cpu_has_native_bf16() is False:
        print(
            f"warning: --trainer.precision {precision} on a CPU without native bf16 "
            "(no amx_bf16 or avx512_bf16 in /proc/cpuinfo): bf16 matmuls are emulated, "
            "and training runs many times slower than in float32. "
            "Pass --trainer.precision 32-true on this machine.",
            file=sys.stderr,
        )


def check_out_beside_run(out: str, root: str) -> None:
    """The export is not the run folder, nor around it: an export's folder is replaced whole by the
    next --overwrite, with the run's checkpoints inside. (An export inside the run folder is
    fine.)"""
    a, b = Path(out).expanduser().absolute(), Path(root).expanduser().absolute()
    if a == b or a in b.parents:
        how = "is" if a == b else "holds"
        raise ValueError(
            f"--out {out!r} {how} the run folder ({root!r}, --trainer.default_root_dir): "
            "the export folder is replaced whole by the next export, and the run's checkpoints "
            "with it; pass --out a folder of its own, "
            f"e.g. out/{b.name} or {Path(root) / 'export'}."
        )


def check_model(model, seq_len: int | None = None, draft_length: int | None = None) -> None:
    """Refuse a model TiDAR cannot convert from its config alone, before greedy documents, data or
    weights (`tidar-convert check` says the same, with the mechanisms and the memory it needs)."""
    from tidar_convert.models.families import require
    from tidar_convert.models.loading import read_config
    from tidar_convert.train.module import check_positions

    config = read_config(model)
    require(config)
    if seq_len and draft_length:
        check_positions(seq_len, draft_length, config)
    # Sliding windows and chunks are applied by the layout, by position (layout.Local); GPT-Neo's
    # local layers apply theirs by index inside the model, which the mask half's indices would
    # break.
    window = getattr(config, "window_size", None)
    if window and seq_len and seq_len > window:
        raise ValueError(
            f"--data.seq_len {seq_len} is longer than {config.model_type}'s local attention "
            f"window ({window}), which its layers apply by token index, not by position: "
            f"the mask half would lose its context; pass --data.seq_len {window} or less."
        )


def check_data(data) -> None:
    """The data settings as far as they can be checked from the files (sources.check_sources)."""
    from tidar_convert.data.checks import check_sources

    sources = [data.source] if isinstance(data.source, str) else list(data.source or [])
    check_sources(
        sources,
        data.get("text_field") or "text",
        data.get("name"),
        data.get("split") or "train",
        data_files=data.get("data_files"),
    )


def check_accelerator(accelerator) -> None:
    """Refuse an accelerator this machine does not have, before any model loads (Lightning's own
    error is a traceback from deep in the Trainer)."""
    import torch

    name = str(accelerator)
    if name in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"--trainer.accelerator {name}: no CUDA GPU is visible on this machine "
            "(torch.cuda.is_available() is False); pass --trainer.accelerator cpu, "
            "or auto to take a GPU where there is one."
        )
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError(
            "--trainer.accelerator mps: this machine has no Apple GPU "
            "(torch.backends.mps.is_available() is False); pass --trainer.accelerator cpu, "
            "or auto."
        )


def training_on_cpu(accelerator) -> bool:
    if str(accelerator) == "cpu":
        return True
    import torch

    return str(accelerator) in ("auto", "None") and not torch.cuda.is_available()


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU computes bf16 natively (AMX or AVX512-BF16); None where it cannot be
    told."""
    try:
        flags = set(Path(cpuinfo).read_text().split())
    except OSError:
        return None
    return bool(flags & {"amx_bf16", "avx512_bf16"})


def device_count(devices) -> int | None:
    """Processes per node as a recipe states `trainer.devices`; None for auto / -1, which only the
    Trainer resolves (it depends on the machine)."""
    if isinstance(devices, (list, tuple)):
        return len(devices)
    text = str(devices).strip()
    if text in ("auto", "-1"):
        return None
    if "," in text:  # "0,1,3": those GPU indices
        return len([x for x in text.split(",") if x.strip()])
    return int(text) if int(text) > 0 else None  # 0: the Trainer's own error says it


def accumulation(
    global_batch_tokens: int | None,
    batch_size: int,
    seq_len: int,
    devices: int,
    nodes: int,
    accumulate: int | None,
) -> int:
    """Gradient accumulation a with micro-batch x seq_len x devices x nodes x a = the global batch.

    `accumulate` is `trainer.accumulate_grad_batches` when the user set it (None = derive it).
    Without a global batch, the run takes what it was given. A global batch that the micro-steps
    cannot reach exactly, or a stated accumulation that disagrees with it, is refused: training
    would silently run at another batch size than the recipe says, and the learning rate was tuned
    for that one.
    """
    if global_batch_tokens is None:
        return accumulate or 1
    per_step = batch_size * seq_len * devices * nodes
    shape = (
        f"micro-batch {batch_size} x seq_len {seq_len} x devices {devices} x nodes {nodes} "
        f"= {per_step} tokens"
    )
    if global_batch_tokens % per_step:
        raise ValueError(
            f"--global_batch_tokens {global_batch_tokens} is not a whole number of micro-steps "
            f"of {shape}; "
            f"set --global_batch_tokens to a multiple of {per_step}, or change --data.batch_size, "
            "--trainer.devices or --trainer.num_nodes."
        )
    needed = global_batch_tokens // per_step
    if accumulate is not None and accumulate != needed:
        raise ValueError(
            f"--trainer.accumulate_grad_batches {accumulate} gives {accumulate * per_step} tokens "
            f"per step with {shape}, "
            f"but --global_batch_tokens is {global_batch_tokens} (accumulation {needed}); "
            "leave out accumulate_grad_batches "
            f"(it is derived), or set --global_batch_tokens {accumulate * per_step}."
        )
    return needed


def global_batch_line(
    batch_size: int, seq_len: int, devices: int, nodes: int, accumulate: int
) -> str:
    total = batch_size * seq_len * devices * nodes * accumulate
    return (
        f"global batch {total} tokens = micro-batch {batch_size} x seq_len {seq_len} "
        f"x devices {devices} x nodes {nodes} x accumulation {accumulate}"
    )
