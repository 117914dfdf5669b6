"""The LightningModule: thin glue over layout (who sees whom) and loss (what is learned)."""

from __future__ import annotations

import copy
from typing import Callable, Iterable

import lightning as L
import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from tidar_convert.models.lora import add_lora, check_scope
from tidar_convert.runtime import layout, recurrent
from tidar_convert.runtime.spec import TiDARSpec
from tidar_convert.train.checkpoints import (
    FROZEN_BASE,
    base_fingerprint,
    check_frozen_base,
    trained_only,
    with_frozen,
)
from tidar_convert.train.loss import check_distill, check_offset_weights, hybrid_loss

OptimizerCallable = Callable[[Iterable], torch.optim.Optimizer]


def adamw(params):
    """The optimizer where a recipe names none: the paper's AdamW at lr 1e-5, no weight decay."""
    return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)


def check_positions(seq_len: int, draft_length: int, config) -> None:
    """Refuse training chunks longer than the base model's positions: the clean half takes
    positions 0..seq_len-1 and the mask half repeats them, so seq_len itself is the limit."""
    positions = getattr(config, "max_position_embeddings", None)
    if positions and seq_len > positions:
        fits = positions - positions % draft_length
        raise ValueError(
            f"--data.seq_len {seq_len} is longer than the base model's {positions} positions "
            "(max_position_embeddings in its config.json): "
            f"tokens past them have positions the model never learned; pass --data.seq_len {fits} "
            f"or less (a multiple of draft_length {draft_length})."
        )


class TiDARModule(L.LightningModule):
    def __init__(
        self,
        model: str | None = None,
        draft_length: int = 4,
        alpha: float = 1.0,
        optimizer: OptimizerCallable | None = None,
        warmup_ratio: float = 0.01,
        min_lr_ratio: float = 0.3,
        lora_r: int = 0,
        lora_alpha: int = 32,
        attn_implementation: str | None = None,
        gradient_checkpointing: bool = False,
        val_decode_prompts: int = 2,
        distill_weight: float = 0.0,
        distill_temperature: float = 1.0,
        teacher: str = "self",
        val_decode_draft_length: int | None = None,
        diff_offset_weights: list[float] | None = None,
        anchor_weight: float = 0.0,
        lora_scope: str = "all",
    ):
        """
        Args:
            model: base checkpoint: hub id, local folder or .gguf file; None = embedded
                SmolLM2-135M-Instruct.
            draft_length: k, tokens drafted per step (and the size of each masked training block).
            alpha: weight of the AR loss: L = (alpha * L_AR + L_Diff) / (1 + alpha).
            optimizer: optimizer factory (YAML: class_path torch.optim.AdamW, init_args lr ...);
                None = `adamw` (AdamW, lr 1e-5, no weight decay).
            warmup_ratio: fraction of max_steps with linear warmup from 0 (transformers'
                get_cosine_with_min_lr_schedule_with_warmup draws the curve).
            min_lr_ratio: cosine decay ends at lr * min_lr_ratio (paper: 1e-5 -> 3e-6, i.e. 0.3).
            lora_r: 0 = full fine-tune; > 0 = LoRA of this rank on all linear layers (mask token row
                trained too).
            lora_alpha: LoRA scaling.
            attn_implementation: None = the family's (families.attention_implementation):
                flex_attention on CUDA, sdpa elsewhere (FlexAttention has no CPU backward), eager
                where the class has neither.
            gradient_checkpointing: recompute activations in backward (large models).
            val_decode_prompts: at each validation, decode this many held-out prompts with TiDAR and
                log `val/tokens_per_nfe` (0 = off).
            distill_weight: w in [0, 1]; the diffusion term becomes
                (1 - w) * L_Diff + w * L_Distill, where L_Distill pulls each mask slot toward the AR
                distribution for the same token (KL, teacher detached; docs/method.md §2). 0 = hard
                labels only (the paper).
            distill_temperature: T > 0 applied to the teacher's logits: 1 = the AR distribution,
                near 0 = its argmax.
            teacher: 'self' = this forward's own AR half (no extra forward); 'base' = the frozen
                base model (adapters disabled, one extra no-grad causal forward of the clean half),
                so the student's drift cannot move the target. 'base' needs LoRA (lora_r > 0).
            val_decode_draft_length: k used by the `val/tokens_per_nfe` decoding
                (None = draft_length). Set it to compare runs trained at different draft lengths at
                the same decode k (train at 8, decode at 4).
            diff_offset_weights: one weight per position in a block (draft_length numbers) for the
                diffusion loss; None = uniform (the paper). Decoding drafts from offsets 1..k-1 only
                (offset 0 sits where the AR token goes) and draft 1 gates the acceptance of the
                others, so the spread is a lever.
            anchor_weight: a in [0, 1]; the AR term becomes (1 - a) * L_AR + a * KL(base || AR): the
                AR half is pulled toward the frozen base model's distribution (adapters off, the
                same extra forward as teacher='base', shared when both are on) instead of the
                training text, so it keeps the base model's text while the diffusion half learns.
                0 = the paper. Needs LoRA (lora_r > 0).
            lora_scope: 'all' = the adapters act on every row (the paper: one set of weights for
                both halves); 'masks' = on mask slots only (lora.py): the AR half stays the base
                model bit for bit, so the conversion writes what the base writes and only the drafts
                are trained. The AR loss then has nothing to move (alpha only scales it),
                teacher='self' is the frozen base already, and there is nothing to anchor. The
                export keeps the deltas apart (tidar_adapter.safetensors).
        """
        super().__init__()
        from tidar_convert.train.settings import check_group

        check_group("model", {k: v for k, v in locals().items() if k not in ("self", "__class__")})
        check_distill(distill_weight, distill_temperature, teacher)
        if distill_weight == 0 and (teacher != "self" or distill_temperature != 1.0):
            # both shape the distillation term only: with distill_weight 0 they would do nothing
            given = " ".join(
                f
                for f, on in (
                    (f"--model.teacher {teacher}", teacher != "self"),
                    (
                        f"--model.distill_temperature {distill_temperature}",
                        distill_temperature != 1.0,
                    ),
                )
                if on
            )
            raise ValueError(
                f"{given} with --model.distill_weight 0: they apply to the distillation term, "
                "which is off; set --model.distill_weight > 0 (e.g. 1.0), or leave them out."
            )
        check_offset_weights(diff_offset_weights, draft_length)
        if anchor_weight > 0 and lora_r <= 0:
            raise ValueError(
                f"anchor_weight={anchor_weight} with lora_r={lora_r}: the base-model anchor needs "
                "LoRA (the base is the weights with the adapters off); set lora_r > 0 (e.g. 64), "
                "or anchor_weight 0."
            )
        if teacher == "base" and lora_r <= 0:
            # Full fine-tuning would need a frozen copy of every weight (twice the memory, and in
            # every checkpoint); with LoRA the base model is the same weights with the adapters
            # switched off.
            raise ValueError(
                f"teacher='base' with lora_r={lora_r}: the frozen-base teacher needs LoRA; set "
                "lora_r > 0 (e.g. 16), or use teacher='self'."
            )
        check_scope(lora_scope, lora_r)
        if lora_scope == "masks" and anchor_weight > 0:
            raise ValueError(
                f"anchor_weight={anchor_weight} with lora_scope='masks': the AR half is the base "
                "model exactly, there is nothing to anchor; set anchor_weight 0."
            )
        if lora_scope == "masks" and teacher == "base":
            raise ValueError(
                "teacher='base' with lora_scope='masks': the AR half is the frozen base already; "
                "use teacher='self' (the same distribution, no extra forward)."
            )
        from tidar_convert.models.families import attention_implementation
        from tidar_convert.models.loading import absolute_model, load_config_and_tokenizer

        self.save_hyperparameters()
        # What checkpoints record: `export` may run in another directory. Set here, not by rebinding
        # the argument: under LightningCLI the hyper-parameters are the config's, as the user gave
        # them.
        model = self.hparams["model"] = absolute_model(model)

        # The config and tokenizer only: the weights are loaded in configure_model(), where the
        # strategy wants them (sharded from the start under ModelParallelStrategy) and in the
        # training dtype.
        self.config, self.tokenizer = load_config_and_tokenizer(model)
        self.attn_implementation = attn_implementation or attention_implementation(
            self.config, "cuda" if torch.cuda.is_available() else "cpu"
        )
        self.model = None
        self._mixers = None  # the model's recurrent layers, once it is built (mixers)
        self._segments = None  # the last training forward's recurrent layout (backward)
        # What makes the model a TiDAR model, written on its config in _prepare (and so exported)
        self.spec = TiDARSpec(draft_length, self.tokenizer.mask_token_id, alpha)
        self.optimizer_factory = optimizer or adamw
        self.warmup_ratio, self.min_lr_ratio, self.val_decode_prompts = (
            warmup_ratio,
            min_lr_ratio,
            val_decode_prompts,
        )
        self.distill_weight, self.distill_temperature, self.teacher = (
            distill_weight,
            distill_temperature,
            teacher,
        )
        self.val_decode_draft_length = val_decode_draft_length or draft_length
        self.diff_offset_weights, self.anchor_weight = diff_offset_weights, anchor_weight

    def configure_model(self) -> None:
        """Build the model. Lightning calls this on every rank once the strategy is set up, with the
        training dtype as the default dtype (bf16 under bf16-true, float32 otherwise); call it
        yourself to use the module outside a Trainer. Idempotent: Lightning calls it again for each
        stage.

        Under ModelParallelStrategy the model is sharded with FSDP2 per decoder layer from its first
        byte (sharding.build_sharded). Its device mesh is (data_parallel, tensor_parallel), by
        default (nodes, devices per node); TiDAR uses no tensor parallelism, so the second dimension
        is the one parameters are sharded over and the first the one they are replicated over (HSDP:
        the all-gathers stay inside a node). `tensor_parallel_size` = world size shards over all
        ranks.
        """
        if self.model is not None:
            return
        from tidar_convert.models.loading import load_base

        dtype = torch.get_default_dtype()
        # set by ModelParallelStrategy before this hook; None under any other
        mesh = self._device_mesh
        if mesh is None:
            self.model = self._prepare(
                load_base(
                    self.hparams.model, attn_implementation=self.attn_implementation, dtype=dtype
                )[0]
            )
        else:
            from tidar_convert.train.sharding import build_sharded

            # rank 0: the checkpoint's own dtype (bf16 for Qwen: half of float32), nothing rounded
            def full():
                return self._prepare(
                    load_base(
                        self.hparams.model,
                        attn_implementation=self.attn_implementation,
                        dtype="auto",
                    )[0]
                )

            self.model = build_sharded(full, lambda: self._prepare(self._empty_model(dtype)), mesh)
        # from_pretrained returns eval mode; Lightning keeps whatever mode it finds
        self.model.train()

    def _empty_model(self, dtype: torch.dtype):
        """The base model on the meta device (no memory), with the rows of the TiDAR tokens."""
        from transformers import AutoModelForCausalLM

        from tidar_convert.models.loading import add_tidar_tokens

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                copy.deepcopy(self.config),
                dtype=dtype,
                attn_implementation=self.attn_implementation,
            )
            # the values come from rank 0
            add_tidar_tokens(model, self.tokenizer, mean_resizing=False)
        return model

    def _prepare(self, model):
        """TiDAR settings, gradient checkpointing and LoRA on a freshly loaded (or meta) base
        model."""
        self.spec.write(model.config)
        if self.hparams.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if self.hparams.lora_r > 0:
            model = add_lora(
                model,
                self.hparams.lora_r,
                self.hparams.lora_alpha,
                self.tokenizer.mask_token_id,
                self.hparams.get("lora_scope", "all"),
            )
        return model

    def unsharded_model(self):
        """The model as one plain module, for export. Sharded: a collective (every rank must call
        it), which returns the gathered model on rank 0 and None on the others."""
        if self._device_mesh is None:
            return self.model
        from tidar_convert.train.sharding import gather_full

        return gather_full(
            self.model,
            lambda: self._prepare(self._empty_model(next(self.model.parameters()).dtype)),
        )

    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None:
            layout.check_train_shape(dm.seq_len, self.spec.draft_length)
            check_positions(dm.seq_len, self.spec.draft_length, self.config)
            # the base model writes the greedy documents
            dm.tokenizer, dm.base_model = self.tokenizer, self.hparams.model or "default"
            if hasattr(dm, "check_greedy_corpus"):
                dm.check_greedy_corpus()
                # generated here, before configure_model loads this module's own weights
                if stage == "fit":
                    from tidar_convert.train.distill import corpus_for_data

                    corpus_for_data(self.trainer, dm)

    @property
    def slim_checkpoints(self) -> bool:
        """LoRA: checkpoints keep the trained weights only (train/checkpoints.py)."""
        return self.hparams.lora_r > 0

    def state_dict(self, *args, **kwargs):
        state = super().state_dict(*args, **kwargs)
        return trained_only(self, state) if self.slim_checkpoints else state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self.slim_checkpoints:
            state_dict = with_frozen(self, state_dict, super().state_dict())
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Record the W&B run this training logs to: a resume continues it
        (fit.continue_wandb_run); and, for LoRA, the base's weight files, which refill the frozen
        weights at load."""
        if self.slim_checkpoints:
            checkpoint[FROZEN_BASE] = base_fingerprint(self.hparams.model)
        for logger in self.trainer.loggers if self._trainer is not None else ():
            if type(logger).__name__ == "WandbLogger" and logger.version is not None:
                checkpoint["wandb_run_id"] = logger.version

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Refuse, before its weights are read, a checkpoint whose parameters this module does not
        have: LoRA where it was a full fine-tune (or the other way round), another rank or scope (a
        key or shape mismatch deep in torch)."""
        where = getattr(self._trainer, "ckpt_path", None) if self._trainer is not None else None
        check_frozen_base(
            checkpoint,
            self.hparams.model,
            f"checkpoint {str(where)!r}" if where else "the checkpoint",
        )
        saved = checkpoint.get("hyper_parameters") or {}
        ours = {"lora_r": self.hparams.lora_r, "lora_scope": self.hparams.get("lora_scope", "all")}
        theirs = {
            "lora_r": saved.get("lora_r", ours["lora_r"]),
            "lora_scope": saved.get("lora_scope", "all"),
        }
        # (a full fine-tune has no scope)
        if ours["lora_r"] == theirs["lora_r"] == 0 or ours == theirs:
            apply_optimizer_settings(checkpoint, self.optimizer_factory)
            return

        def kind(s):
            return (
                f"lora_r={s['lora_r']}, lora_scope={s['lora_scope']!r}"
                if s["lora_r"] > 0
                else "lora_r=0 (a full fine-tune)"
            )

        flags = " ".join(f"--model.{k} {v}" for k, v in theirs.items() if v != ours[k])
        raise ValueError(
            f"{f'checkpoint {str(where)!r}' if where else 'the checkpoint'} was trained with "
            f"{kind(theirs)} and this run has {kind(ours)}: "
            f"its weights do not fit; resume with {flags}, or start a new run from its export "
            "(`tidar-convert export --checkpoint CKPT --out DIR`, then --model.model DIR without "
            "--ckpt_path)."
        )

    def forward_tidar(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        no_ar_target: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The hybrid loss and metrics of a batch; `no_ar_target` (B, S) marks tokens the AR loss
        does not learn to predict (self-distilled text with --data.greedy_ar_loss false): they train
        the diffusion half only."""
        B, S = input_ids.shape
        layout.check_train_shape(S, self.spec.draft_length)
        mask_mod = layout.train_mask_mod(S, self.spec.draft_length, doc_ids)
        inputs = layout.train_inputs(input_ids, self.model.config.mask_token_id)
        positions = layout.train_position_ids(input_ids, doc_ids)
        if self.split_halves:
            logits = self.forward_halves(inputs, positions, mask_mod)
        else:
            # sliding windows and chunks, by position
            local = layout.Local.of(self.model.config, positions)
            mask = layout.build_mask(
                mask_mod, B, 2 * S, 2 * S, self.attn_implementation, input_ids.device, local
            )
            # recurrent layers: each mask block from the state before it (runtime/recurrent.py)
            segments = self._segments = recurrent.Segments.training(S, self.spec.draft_length)
            with recurrent.layout(self.mixers, segments):
                logits = self.model(
                    input_ids=inputs, position_ids=positions, attention_mask=mask, use_cache=False
                ).logits
        ar_labels, diff_labels = layout.train_labels(input_ids, doc_ids, no_ar_target)
        base_teacher = self.teacher == "base" and self.distill_weight > 0
        # one forward of the frozen base serves both the teacher and the anchor
        base_logits = (
            self.base_ar_logits(input_ids, doc_ids)
            if base_teacher or self.anchor_weight > 0
            else None
        )
        return hybrid_loss(
            logits,
            ar_labels,
            diff_labels,
            self.spec.alpha,
            self.spec.draft_length,
            distill_weight=self.distill_weight,
            distill_temperature=self.distill_temperature,
            teacher_logits=base_logits if base_teacher else None,
            offset_weights=self.diff_offset_weights,
            anchor_weight=self.anchor_weight,
            anchor_logits=base_logits if self.anchor_weight > 0 else None,
        )

    def backward(self, loss, *args, **kwargs) -> None:
        """Activation checkpointing recomputes the forward in here: its recurrent layers run the
        same layout as the forward did (runtime/recurrent.py), not a plain scan."""
        checkpointed = self.hparams.gradient_checkpointing and self.mixers
        with recurrent.layout(self.mixers, self._segments if checkpointed else None):
            super().backward(loss, *args, **kwargs)

    @property
    def mixers(self) -> list:
        """The model's layers with recurrent state (runtime/recurrent.py), found once."""
        if self._mixers is None:
            self._mixers = recurrent.mixers(self.model)
        return self._mixers

    @property
    def split_halves(self) -> bool:
        """lora_scope='masks' (without activation checkpointing, which drops the cache, and without
        recurrent layers, whose mask blocks need the clean half's state at every block): the clean
        half runs once without autograd and hands its keys and values to the mask half."""
        return (
            self.hparams.get("lora_scope", "all") == "masks"
            and not self.hparams.gradient_checkpointing
            and not self.mixers
        )

    def forward_halves(
        self, inputs: torch.Tensor, positions: torch.Tensor, mask_mod
    ) -> torch.Tensor:
        """(B, 2S, V) logits of the doubled sequence in two forwards: the clean half under no_grad
        (under lora_scope='masks' nothing trainable reaches it, so it needs no graph), then the mask
        half with the clean half's keys and values as its cache. The same logits as one forward over
        both halves, with the backward of the mask half only: about 2/3 of the compute of a training
        step."""
        from transformers import DynamicCache

        from tidar_convert.runtime.forward import cache_kwargs

        B, S2 = inputs.shape
        S = S2 // 2
        device, impl = inputs.device, self.attn_implementation
        cache = DynamicCache()
        with torch.no_grad():
            local = layout.Local.of(self.model.config, positions[:, :S])
            clean = self.model(
                input_ids=inputs[:, :S],
                position_ids=positions[:, :S],
                attention_mask=layout.build_mask(mask_mod, B, S, S, impl, device, local),
                **cache_kwargs(self.model, cache),
            ).logits

        # the mask half's rows of the same layout
        def half_mod(b, h, q, kv):
            return mask_mod(b, h, q + S, kv)

        local = layout.Local.of(self.model.config, positions, q_offset=S)
        masks = self.model(
            input_ids=inputs[:, S:],
            position_ids=positions[:, S:],
            attention_mask=layout.build_mask(half_mod, B, S, S2, impl, device, local),
            **cache_kwargs(self.model, cache),
        ).logits
        return torch.cat([clean, masks], 1)

    @torch.no_grad()
    def base_ar_logits(
        self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, S, V) AR logits of the frozen base model (LoRA adapters off) on the clean tokens
        alone.

        The clean half never sees a mask slot, so a plain causal forward over the S clean tokens
        (with the same document isolation and positions) is exactly the clean half the base model
        would compute.
        """
        B, S = input_ids.shape
        positions = layout.train_position_ids(input_ids, doc_ids)[:, :S]
        local = layout.Local.of(self.model.config, positions)
        mask = layout.build_mask(
            layout.train_mask_mod(S, self.spec.draft_length, doc_ids),
            B,
            S,
            S,
            self.attn_implementation,
            input_ids.device,
            local,
        )
        with self.model.disable_adapter():
            return self.model(
                input_ids=input_ids,
                position_ids=positions,
                attention_mask=mask,
                use_cache=False,
            ).logits

    def training_step(self, batch, batch_idx):
        out = self.forward_tidar(
            batch["input_ids"], batch.get("doc_ids"), batch.get("no_ar_target")
        )
        if not torch.isfinite(out["loss"]):
            ckpt = (
                getattr(self.trainer.checkpoint_callback, "last_model_path", "") or "none saved yet"
            )
            raise FloatingPointError(
                f"non-finite loss ({out['loss'].item()}) at step {self.global_step}; stopped "
                f"before the update, so the weights and the last checkpoint ({ckpt}) are still "
                "good. Lower the learning rate, or use bf16-mixed instead of 16-mixed precision."
            )
        self.log_dict(
            {f"train/{k}": v for k, v in out.items()},
            prog_bar=False,
            batch_size=batch["input_ids"].shape[0],
        )
        self.log("loss", out["loss"], prog_bar=True, logger=False)
        return out["loss"]

    def validation_step(self, batch, batch_idx):
        out = self.forward_tidar(batch["input_ids"], batch.get("doc_ids"))
        if batch_idx < self.val_decode_prompts:
            chunk = batch["input_ids"][:1]
            # sharded: each forward all-gathers, so every rank decodes rank 0's chunk (same
            # forwards)
            if self._device_mesh is not None:
                chunk = self.trainer.strategy.broadcast(chunk)
            out["tokens_per_nfe"] = torch.tensor(self.decode_tokens_per_nfe(chunk))
        self.log_dict(
            {f"val/{k}": v for k, v in out.items()}, batch_size=batch["input_ids"].shape[0]
        )

    @torch.no_grad()
    def decode_tokens_per_nfe(
        self, chunk: torch.Tensor, prompt_len: int = 32, new_tokens: int = 32
    ) -> float:
        """Greedy TiDAR decoding from the start of a held-out chunk: the real acceptance, not a
        proxy. Diffusion drafts only, a group at every acceptance length: what is measured is the
        diffusion head being trained (lookup drafts would credit it with the text's own repeats)."""
        from tidar_convert.runtime.generate import generate

        model = self.model
        was_training = model.training
        model.eval()
        try:
            generate(
                chunk[:, :prompt_len],
                model=model,
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                draft_length=self.val_decode_draft_length,
                drafter="diffusion",
                plan="full",
            )
            return model.tidar_stats["tokens_per_nfe"]
        finally:
            model.train(was_training)

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params)
        total = max(
            1,
            self.trainer.max_steps
            if self.trainer.max_steps > 0
            else self.trainer.estimated_stepping_batches,
        )
        # transformers' curve, as its Trainer draws it: linear from 0 over warmup_ratio x total
        # steps, then a half cosine from lr down to lr x min_lr_ratio at the last step
        scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            optimizer,
            num_warmup_steps=int(self.warmup_ratio * total),
            num_training_steps=total,
            min_lr_rate=self.min_lr_ratio,
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def apply_optimizer_settings(checkpoint: dict, factory) -> None:
    """Write this run's optimizer arguments into a checkpoint's optimizer state before Lightning
    restores it (which would keep the old lr, weight decay... without a word). The schedule's
    progress stays: the lr the schedule had reached is scaled by new lr / old lr."""
    states = checkpoint.get("optimizer_states") or []
    if not states:
        return
    probe = factory([torch.nn.Parameter(torch.zeros(1))]).defaults  # this run's arguments
    for state in states:
        for group in state.get("param_groups", []):
            old_lr = group.get("initial_lr", group.get("lr"))
            for key, value in probe.items():
                if (
                    key in group
                    and key not in ("lr", "initial_lr")
                    and isinstance(value, (int, float, bool, tuple, type(None)))
                ):
                    group[key] = value
            new_lr = probe.get("lr")
            if isinstance(new_lr, (int, float)) and old_lr and new_lr != old_lr:
                group["lr"] = group["lr"] * new_lr / old_lr
                if "initial_lr" in group:
                    group["initial_lr"] = new_lr
    for sched in checkpoint.get("lr_schedulers") or []:
        new_lr = probe.get("lr")
        if "base_lrs" in sched and isinstance(new_lr, (int, float)):
            sched["base_lrs"] = [new_lr] * len(sched["base_lrs"])
            groups = states[0].get("param_groups", [])
            if "_last_lr" in sched and len(groups) == len(sched["_last_lr"]):
                sched["_last_lr"] = [g["lr"] for g in groups]
