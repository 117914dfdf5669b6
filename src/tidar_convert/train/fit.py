"""`tidar-convert fit | validate`: the LightningCLI, its checks before a model loads (settings,
accelerator, global batch, resume), and what a run says and exports when it ends.

cli.main imports this module only for fit/validate: it imports Lightning at once, which the
typed commands (export, generate, ...) need not pay for.
"""

from __future__ import annotations

import json as jsonlib
import os
import sys
from pathlib import Path
from typing import Literal

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

from tidar_convert.exports.card import training_card  # noqa: F401  (fit and export use it)
from tidar_convert.train.callbacks import RunClock, Throughput, TrainProgress
from tidar_convert.train.checkpoints import FinalCheckpoint, atomic_checkpoints
from tidar_convert.train.checks import (
    accumulation,
    check_accelerator,
    check_data,
    check_fit_config,
    check_model,
    check_out_beside_run,
    device_count,
    global_batch_line,
)
from tidar_convert.train.preemption import Preemption


class RunFolderConfig(SaveConfigCallback):
    """config.yaml goes into the run folder (trainer.default_root_dir), never into the working
    directory, where a logger without save_dir would put it and overwrite the user's own file. Its
    first line marks it as fit's (run_folder.CONFIG_MARK): a config.yaml without it is never
    replaced (checked before the run starts). `validate` leaves the run's config as it is.
    Every logger gets the same whole config (`save_config`)."""

    def setup(self, trainer, pl_module, stage):
        if self.already_saved:
            return
        if trainer.is_global_zero:
            if stage == "fit":
                from tidar_convert.exports.outputs import atomic_file
                from tidar_convert.train.run_folder import CONFIG, CONFIG_MARK

                text = self.parser.dump(self.config, skip_none=False)
                with atomic_file(Path(trainer.default_root_dir) / CONFIG) as tmp:
                    tmp.write_text(f"{CONFIG_MARK}\n{text}")
            self.save_config(trainer, pl_module, stage)
        self.already_saved = True

    def save_config(self, trainer, pl_module, stage):
        """LightningCLI's hook for the config's other homes: the loggers get all of it under
        `config`, nested as in config.yaml (trainer, data, optimizer, seed...), where Lightning logs
        only the model's and the data's arguments, flat (its `model` is the base model's path, so
        the sections cannot sit beside them)."""
        import yaml

        config = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
        for logger in trainer.loggers:
            logger.log_hyperparams({"config": config})


class TiDARCLI(LightningCLI):
    def __init__(self, *args, signals=None, **kwargs):
        # preemption.Signals of this fit; set first: LightningCLI.__init__ parses, instantiates
        # and runs
        self.signals = signals
        # the checkpoint --ckpt_path names, once resolved (_parse_ckpt_path)
        self.resume_path = None
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser):
        parser.add_argument(
            "--out",
            type=str | None,
            default=None,
            help="export the trained model to this folder after fit",
        )
        parser.add_argument(
            # A bare `--overwrite` (as `export` and `distill` take it, and `make convert` passes it)
            # or a value.
            "--overwrite",
            type=bool,
            nargs="?",
            const=True,
            default=False,
            help="let --out replace an earlier export of this tool "
            "(anything else in that folder is never replaced)",
        )
        # Top level, not under data: it ties the data (micro-batch, seq_len) to the trainer
        # (devices, nodes, accumulation), and belongs to neither.
        parser.add_argument(
            "--global_batch_tokens",
            type=int | None,
            default=None,
            help="tokens per optimizer step over all devices and nodes; "
            "trainer.accumulate_grad_batches is derived from it",
        )
        # None = "not set": then it is derived from global_batch_tokens, and a value the user did
        # set can be checked against it (a default of 1 could not be told apart from an explicit 1).
        parser.add_argument(
            "--existing_run",
            type=Literal["refuse", "new", "replace"],
            default="refuse",
            help="a run folder holding another run's checkpoints: refuse "
            "(default; --ckpt_path last continues it), new (this run goes to <folder>-v2, -v3...) "
            "or replace (its checkpoints go)",
        )
        parser.set_defaults(
            {"trainer.default_root_dir": "runs/tidar", "trainer.accumulate_grad_batches": None}
        )

    def _parse_ckpt_path(self):
        # Lightning would replace the model settings with those the --ckpt_path file was trained
        # with (and not at all for `last`): any the user set otherwise would be dropped without a
        # word. Instead every setting is compared with the checkpoint's (resume.check_settings).
        sub = self.config.get("subcommand")
        cfg = self.config[sub] if sub else None
        self.resume_path = None
        if cfg is None or not cfg.get("ckpt_path") or cfg.ckpt_path in ("best", "hpc"):
            return
        from tidar_convert.train.resume import check_settings, resolve

        self.resume_path = resolve(cfg)
        if self.resume_path is not None:
            check_settings(self.resume_path, cfg)

    def before_instantiate_classes(self):
        cfg = self.config[self.subcommand]
        self.accumulate = cfg.trainer.get("accumulate_grad_batches")  # as the user set it, or None
        check_accelerator(cfg.trainer.get("accelerator"))
        if self.subcommand == "fit":
            from tidar_convert.train import settings
            from tidar_convert.train.run_folder import check_run_folder, place_outputs

            check_fit_config(cfg)
            settings.check_config(cfg)
            old_root = Path(cfg.trainer.get("default_root_dir") or ".")
            moved = check_run_folder(
                cfg, cfg.get("existing_run") or "refuse", resuming=bool(cfg.get("ckpt_path"))
            )
            if moved is not None:
                cfg.trainer.default_root_dir = str(moved)
                if cfg.get("out"):
                    check_out_beside_run(cfg.out, str(moved))
            place_outputs(cfg, old_root if moved is not None else None)
            if self.signals is not None:
                # where to say that a run stopped before its first step
                self.signals.run_dir = cfg.trainer.get("default_root_dir")
                self.signals.new_run_dir = not Path(cfg.trainer.default_root_dir).exists()
            devices = device_count(cfg.trainer.get("devices", "auto"))
            # refuse before the model loads; auto is checked once the Trainer resolved it
            if devices is not None:
                accumulation(
                    cfg.get("global_batch_tokens"),
                    cfg.data.batch_size,
                    cfg.data.seq_len,
                    devices,
                    cfg.trainer.get("num_nodes") or 1,
                    self.accumulate,
                )
            # The settings' own arithmetic first (no I/O), then the data, then the model's config:
            # all before any work.
            model, data = cfg.get("model"), cfg.get("data")
            if model is not None and data is not None:
                from tidar_convert.runtime.layout import check_train_shape

                check_train_shape(data.seq_len, model.draft_length)
            if data is not None:
                check_data(data)
            check_model(
                model.get("model") if model is not None else None,
                data.get("seq_len") if data is not None else None,
                model.get("draft_length") if model is not None else None,
            )
        else:
            from tidar_convert.train import settings

            settings.check_config(cfg)
            if cfg.get("data") is not None:
                check_data(cfg.data)
        # placeholder for the Trainer; set in after_instantiate
        cfg.trainer.accumulate_grad_batches = self.accumulate or 1
        if cfg.trainer.get("enable_progress_bar") is False:  # Lightning refuses a bar callback then
            self.trainer_defaults["callbacks"] = [
                cb for cb in self.trainer_defaults["callbacks"] if not isinstance(cb, TrainProgress)
            ]

    def after_instantiate_classes(self):
        trainer = self.trainer
        root = Path(trainer.default_root_dir)
        # a full disk or a kill while saving leaves the previous checkpoint whole
        atomic_checkpoints(trainer.strategy)
        for cb in trainer.checkpoint_callbacks:
            # Without a dirpath, Lightning puts checkpoints under the logger's per-run folder, which
            # a new run cannot find again: --ckpt_path last would then start from scratch.
            if isinstance(cb, ModelCheckpoint) and cb.dirpath is None:
                cb.dirpath = str((root / "checkpoints").resolve())
            if isinstance(cb, ModelCheckpoint):
                # A run folder is one run's (run_folder.check_run_folder): its resumed run writes
                # over its own last.ckpt, never last-v1.ckpt beside it for `last` to mistake.
                cb._enable_version_counter = False
        for logger in trainer.loggers:
            # Lightning always passes `anonymous`, and W&B warns on every run that it has no effect.
            getattr(logger, "_wandb_init", {}).pop("anonymous", None)
        if self.subcommand in ("fit", "validate"):
            given = self.config[self.subcommand].get("ckpt_path")
            resume = check_resume(trainer, given, self.subcommand, self.resume_path)
            # the file `last` names, or None: the earlier run stopped before its first step
            if resume != given:
                self.config_init[self.subcommand]["ckpt_path"] = resume
            if resume is not None and self.subcommand == "fit":
                continue_wandb_run(trainer, resume)
            if self.signals is not None:
                self.signals.resume_from = resume
        if self.subcommand == "fit":
            self.set_accumulation()

    def set_accumulation(self):
        """Derive accumulation from the global batch with the devices the Trainer resolved, and say
        it."""
        cfg, trainer, data = self.config[self.subcommand], self.trainer, self.datamodule
        shape = (data.batch_size, data.seq_len, trainer.num_devices, trainer.num_nodes)
        trainer.accumulate_grad_batches = accumulation(
            cfg.get("global_batch_tokens"), *shape, self.accumulate
        )
        # config.yaml keeps a derived accumulation unset (null): rerun on other devices, it is
        # derived again
        cfg.trainer.accumulate_grad_batches = (
            self.accumulate if cfg.get("global_batch_tokens") else trainer.accumulate_grad_batches
        )
        if trainer.is_global_zero:
            print(
                global_batch_line(*shape, trainer.accumulate_grad_batches),
                file=sys.stderr,
                flush=True,
            )

    def after_fit(self):
        trainer = self.trainer
        saved = [
            cb.last_model_path
            for cb in trainer.checkpoint_callbacks
            if getattr(cb, "last_model_path", "")
        ]
        if trainer.is_global_zero:
            print(
                f"trained {trainer.global_step} steps; "
                f"run folder {Path(trainer.default_root_dir).resolve()}",
                file=sys.stderr,
            )
            for path in saved:
                print(f"checkpoint: {path}{saved_step(path, trainer.global_step)}", file=sys.stderr)
            for logger in trainer.loggers:
                run = getattr(logger, "_experiment", None)  # only a run that was started
                if run is not None and getattr(run, "dir", None):
                    offline = (
                        getattr(run.settings, "_offline", False)
                        or os.environ.get("WANDB_MODE") == "offline"
                    )
                    where = Path(run.dir).parent
                    print(
                        f"W&B run: {where}"
                        + (
                            f" (offline; upload with `wandb sync {where}`)"
                            if offline
                            else f" ({run.url})"
                        ),
                        file=sys.stderr,
                    )
        cfg = self.config[self.subcommand]
        if cfg.get("out"):
            m = self.model
            # sharded: every rank takes part in gathering it onto rank 0
            model = m.unsharded_model()
            if trainer.is_global_zero:
                from tidar_convert.exports.folder import export, export_dtype

                card = training_card(m.hparams, trainer.global_step, Path(trainer.default_root_dir))
                path = export(
                    model,
                    m.tokenizer,
                    cfg.out,
                    m.spec,
                    overwrite=bool(cfg.get("overwrite")),
                    card=card,
                    dtype=export_dtype(None, m.config),  # the base's, as `export` does
                )
                print(f"exported TiDAR model to {path}", file=sys.stderr)


def saved_step(path: str, final: int) -> str:
    """' (step N)' as read back from the checkpoint itself, and a warning where N is not the final
    step."""
    if "://" in path or not Path(path).exists():
        return ""
    from tidar_convert.train.run_folder import checkpoint_step

    step = checkpoint_step(Path(path))
    return (
        f" (step {step})"
        if step == final
        else f" (step {step}: the final step {final} is in no checkpoint)"
    )


def _lightning_cli(args: list[str] | None, signals=None) -> TiDARCLI:
    # imported here, after run() quieted the libraries: their import-time warnings stay silenced
    from tidar_convert.data import TiDARData
    from tidar_convert.train.module import TiDARModule
    from tidar_convert.train.recipe import TiDARParser, check_recipe, config_files

    for path in config_files(list(sys.argv[1:] if args is None else args)):
        # a duplicate key or a tab, named by file and line (jsonargparse would not)
        check_recipe(path)
    # every recipe logs throughput, memory and its clock
    callbacks = [TrainProgress(), Preemption(signals), Throughput(), RunClock(), FinalCheckpoint()]
    return TiDARCLI(
        TiDARModule,
        TiDARData,
        args=args,
        save_config_callback=RunFolderConfig,
        parser_class=TiDARParser,
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"callbacks": callbacks},
        # TiDARModule builds its optimizer and schedule from --model.*: LightningCLI's own
        # --optimizer / --lr_scheduler would be overridden by configure_optimizers, so they are not
        # flags (recipe.suggestion names the keys to use)
        signals=signals,
    )


def _run_lightning(argv: list[str] | None) -> None:
    import signal

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from tidar_convert.train.preemption import Interrupted, Signals

    command = (sys.argv[1:] if argv is None else argv)[:1]
    with Signals(active=command == ["fit"]) as signals:
        try:
            _lightning_cli(argv, signals)  # None: LightningCLI reads sys.argv itself
        except SIGTERMException:
            # the Preemption callback saved last.ckpt (or found nothing to save) and said so;
            # 128 + the signal: "killed", so a scheduler requeues instead of marking it done
            sys.exit(128 + (signals.signum or signal.SIGTERM))
        except Interrupted as e:  # before training ran: nothing to save
            signals.nothing_saved()
            sys.exit(128 + e.signum)
        except SystemExit:
            # a second Ctrl-C: Lightning stopped at once (Preemption said so) and exits 1
            if signals.count > 1:
                sys.exit(128 + signal.SIGINT)
            raise
        except Exception:
            # refused or failed before it saved anything: no empty run folder left behind
            trained = signals.trainer is not None and signals.trainer.global_step > 0
            if signals.new_run_dir and signals.run_dir and not trained:
                from tidar_convert.train.run_folder import discard_if_unused

                discard_if_unused(Path(signals.run_dir))
            raise


def continue_wandb_run(trainer, checkpoint) -> None:
    """A resumed fit logs to the W&B run its checkpoint recorded (TiDARModule.on_save_checkpoint),
    not to a new one, unless the recipe names a run id of its own."""
    loggers = [logger for logger in trainer.loggers if type(logger).__name__ == "WandbLogger"]
    if not loggers:
        return
    from tidar_convert.train.run_folder import read_checkpoint

    run_id = read_checkpoint(Path(checkpoint)).get("wandb_run_id")
    for logger in loggers:
        # before its run starts (the first metric logged): W&B reads these at wandb.init
        if run_id and logger._experiment is None and not logger._wandb_init.get("id"):
            logger._wandb_init.update(id=run_id, resume="allow")
            logger._id = run_id


def check_resume(trainer, ckpt_path, command: str = "fit", resolved: Path | None = None):
    """The checkpoint to start from (None: from scratch): `resolved`, what --ckpt_path `ckpt_path`
    names (resume.resolve: for `last`, the checkpoint with the highest step), once checked.

    `--ckpt_path last` with nothing to resume is an error: Lightning would warn and silently start
    from scratch (fit: a requeued job would then redo, and overwrite, the work it was meant to
    continue; validate: it would validate the untrained base model as if it were the trained one).
    Except after a fit stopped by a signal before its first step (preemption.NOTHING_SAVED in the
    run folder): there is nothing to redo, so it starts from scratch, and says so."""
    if ckpt_path is None:
        return None
    from lightning.pytorch.callbacks import ModelCheckpoint

    if ckpt_path == "last":
        dirs = [
            cb.dirpath for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)
        ]
        if resolved is None:
            from tidar_convert.train.preemption import NOTHING_SAVED

            stopped = Path(trainer.default_root_dir) / NOTHING_SAVED
            if command == "fit" and stopped.is_file():
                try:
                    how = jsonlib.loads(stopped.read_text())["signal"]
                except (OSError, ValueError, KeyError, TypeError):
                    how = "a signal"
                if trainer.is_global_zero:
                    print(
                        f"--ckpt_path last: the run in {trainer.default_root_dir} was stopped by "
                        f"{how} before its first step and saved nothing: starting from scratch.",
                        file=sys.stderr,
                        flush=True,
                    )
                return None
            where = (
                ", ".join(map(str, dirs)) or "nowhere: no ModelCheckpoint callback is configured"
            )
            instead = (
                "train from scratch" if command == "fit" else "validate the base model as it is"
            )
            raise FileNotFoundError(
                f"--ckpt_path last: no last checkpoint in {where}. "
                f"Leave out --ckpt_path to {instead}, "
                "or pass a checkpoint file (--ckpt_path runs/.../checkpoints/last.ckpt)."
            )
    elif ckpt_path in ("best", "hpc"):
        return ckpt_path
    elif resolved is None:
        raise FileNotFoundError(
            f"--ckpt_path {ckpt_path}: no such checkpoint; `fit` writes them under "
            "<default_root_dir>/checkpoints/."
        )
    check_checkpoint_format([resolved], trainer.strategy)
    if trainer.is_global_zero and ckpt_path == "last":
        from tidar_convert.train.run_folder import checkpoint_step

        print(
            f"--ckpt_path last: resuming {resolved} (step {checkpoint_step(resolved)}).",
            file=sys.stderr,
            flush=True,
        )
    return str(resolved)


def check_checkpoint_format(paths, strategy) -> None:
    """A folder of shards resumes only under the strategy that reads them; any other would fail deep
    in torch.load (a directory) or load nothing."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from tidar_convert.train.sharding import is_sharded_checkpoint

    for path in paths:
        if is_sharded_checkpoint(path) and not isinstance(strategy, ModelParallelStrategy):
            raise ValueError(
                f"--ckpt_path {path} is a sharded checkpoint (a folder of one file per rank, "
                "written by ModelParallelStrategy), "
                f"and this run's strategy is {type(strategy).__name__}; "
                "resume it with the strategy that wrote it "
                "(--trainer.strategy lightning.pytorch.strategies.ModelParallelStrategy, "
                "as the paper recipes set it), "
                "or turn it into a model folder with "
                "`tidar-convert export --checkpoint PATH --out DIR` and train from that."
            )


def _quiet_libraries() -> None:
    """Keep fit's output to what a user acts on: our progress lines, errors, and where files went.

    W&B's banners, Lightning's device table and advertisements, and third-party deprecation
    warnings (which the user cannot act on) are silenced; `TIDAR_VERBOSE=1` brings them back.
    """
    import logging
    import warnings

    if os.environ.get("TIDAR_VERBOSE"):
        return
    os.environ.setdefault("WANDB_SILENT", "true")
    import lightning.pytorch  # noqa: F401  (its import sets its loggers to INFO: lower them after)
    import transformers

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # "new embeddings will be initialized ..." on every run
    transformers.logging.set_verbosity_error()
    for category in (DeprecationWarning, FutureWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    for pattern in (
        # streaming data: extra workers would read the same stream
        r".*does not have many workers.*",
        r".*`IterableDataset` has `__len__`.*",
        r".*Total length of `DataLoader` across ranks is zero.*",
        r".*The number of training batches .* is smaller than the logging interval.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)


def _finish_wandb() -> None:
    """Close the W&B run of this fit, however it ended. Lightning leaves it open, and the next
    WandbLogger in the same process (a notebook, a test, a sweep in-process) would silently log into
    it, in the old run's folder."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()


def run(argv: list[str] | None) -> None:
    """`tidar-convert fit | validate ...` (argv None: sys.argv[1:])."""
    _quiet_libraries()
    try:
        _run_lightning(argv)
    finally:
        _finish_wandb()
