"""Adapters that act on mask slots only (lora_scope='masks'): the AR half stays the base model,
exactly.

A converted model trained with `--model.lora_scope masks` keeps its low-rank deltas apart from the
base weights and applies them only to the rows of mask tokens. Every other row (the prompt,
committed text, the drafts a step verifies) goes through the base weights untouched, and a row only
ever attends to real tokens and to mask slots of its own group, so every AR distribution, and so
every token TiDAR commits, is the base model's, bit for bit. Only the drafts come from adapted rows.
Plain AR decoding and perplexity are those of the base model by construction: converting cannot
make the model write worse.

One gate per model, set by a pre-hook on the input embedding (every forward path embeds its tokens
first: model(), its decoder alone, PEFT's wrapper) and read by each adapted layer. Decoding tells
the gate where its forward's mask rows are (`mask_rows`: TiDAR's steps their groups, plain AR
none), so it reads nothing from the ids: a read is a device wait each forward on a GPU, and a
graph break under torch.compile. A forward nobody told about (training, a caller's own model()
call) has its mask rows read from the ids. A mask token inside the text is text in decoding: no
row of it is adapted, in TiDAR's forwards and in plain AR's alike.
In training the gate multiplies PEFT's LoRA branch (lora.gate_to_masks); in an export it adds the
saved deltas (ADAPTER_FILE, attach). The engine lays out a step's mask groups after its drafts and a
training sequence's masks after its clean half, so the rows are one trailing block: a slice, no
gather.

On generate()'s panel products (fp32 and bf16) the deltas of a batch-1 step's mask rows run inside
each weight's pass (kernels.packed_forward: B packed beside W, the hook set aside); elsewhere the
hook adds them.

Shipped in every export's custom_generate/ folder with the rest of runtime/: imports nothing but
torch, transformers (safetensors comes with transformers) and its neighbours.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .kernels import DELTA_HOOK, LORA_A, LORA_BT, LORA_GATE
from .panel import lora_add
from .spec import TiDARSpec

ADAPTER_FILE = "tidar_adapter.safetensors"
GATE_ATTR = "_tidar_gate"


class Gate:
    """Which rows of the current forward are mask slots: a trailing block from column `start` in
    every row (the layouts this repo builds), or else an explicit (B, T) boolean `rows`, or a
    (B, T, 1) boolean `where` (a compiled forward's: the delta on every row, kept where true);
    none = no mask rows. `told`: what decoding said of the forwards it runs (mask_rows), or None:
    read from the ids."""

    def __init__(self, mask_id: int):
        self.mask_id = mask_id
        self.start: int | None = None
        self.rows: torch.Tensor | None = None
        self.where: torch.Tensor | None = None
        self.told: tuple | None = None
        self.shape: tuple = ()  # (B, T) of the current input ids
        # (B, T, dtype, device) -> weights(): one tensor per forward, not one per layer
        self._weights: dict = {}

    def set(self, input_ids: torch.Tensor) -> None:
        self.start = self.rows = self.where = None
        self.shape = tuple(input_ids.shape[:2])
        self._weights = {}
        if self.told is not None:
            (rows,) = self.told
            if isinstance(rows, int):
                self.start = rows if rows < input_ids.shape[1] else None
            elif rows is not None:
                self.where = rows[..., None]
            return
        is_mask = input_ids == self.mask_id
        if input_ids.ndim != 2 or not bool(is_mask.any()):
            return
        start = int(is_mask.any(0).int().argmax())
        if bool(is_mask[:, start:].all()):
            self.start = start
        else:
            self.rows = is_mask

    @property
    def open(self) -> bool:
        return self.start is not None or self.rows is not None or self.where is not None

    def weights(self, like: torch.Tensor) -> torch.Tensor:
        """(B, T, 1) ones on mask rows, zeros elsewhere, in like's dtype (training: multiplies the
        LoRA branch)."""
        B, T = like.shape[:2]
        # tokens out of sequence order: which are mask rows is unknown
        if self.open and like.dim() == 3 and (B, T) != self.shape:
            raise RuntimeError(
                f"a mask-slot adapter saw {tuple(like.shape)} where the input ids are "
                f"{tuple(self.shape)}: a layer that runs on "
                "tokens out of sequence order (lora.out_of_order) has an adapter; "
                "lora_scope='masks' cannot gate it."
            )
        key = (B, T, like.dtype, like.device)
        if key not in self._weights:
            w = torch.zeros(B, T, 1, dtype=like.dtype, device=like.device)
            if self.where is not None:
                w = self.where.to(like.dtype).expand(B, T, 1)
            elif self.start is not None:
                w[:, self.start :] = 1
            elif self.rows is not None:
                w[self.rows] = 1
            self._weights[key] = w
        return self._weights[key]

    def add(
        self, out: torch.Tensor, x: torch.Tensor, A: torch.Tensor, Bt: torch.Tensor
    ) -> torch.Tensor:
        """out += x @ A.T @ Bt on the mask rows only (inference: the saved adapter's hook, or the
        packed forward where the panel pass did not add it); A (r, in), Bt (r, out), in their own
        dtype (attach: fp32 on CPU). A decoding step of one row has its mask rows as one contiguous
        block: on CPU, in fp32 or bf16, one C call there (panel.lora_add), else one mm and one
        in-place addmm; this runs on every adapted layer, ~150 a forward, and its overhead, not its
        FLOPs, is its cost (torch's products and their slicing, per layer: bench/LOG.md, "the
        adapter's delta inside the panel pass")."""
        if (
            self.start is not None
            and out.device.type == "cpu"
            and lora_add(out, x, self.start, A, Bt)
        ):
            return out
        At = A.T

        def delta(v):
            return (v.to(At.dtype) @ At @ Bt).to(out.dtype)

        if self.start is not None:
            if out.shape[0] == 1 and out.is_contiguous() and x.is_contiguous():
                rows, xs = (
                    out.view(-1, out.shape[-1])[self.start :],
                    x.view(-1, x.shape[-1])[self.start :],
                )
                if At.dtype == out.dtype:
                    rows.addmm_(xs.mm(At), Bt)
                else:
                    rows += delta(xs)
            else:
                out[:, self.start :] += delta(x[:, self.start :])
        elif self.rows is not None:
            out[self.rows] += delta(x[self.rows])
        elif self.where is not None:  # no data-dependent shape: what a compiled graph can hold
            return torch.where(self.where, out + delta(x), out)
        return out


@contextmanager
def mask_rows(model, rows):
    """The forwards inside have these mask rows, so the model's gate (if it has one) reads nothing
    from their ids: None, no mask rows (plain AR decoding); an int, every row's slots from there
    on (TiDAR's prefill and steps lay out their groups after the rest); a (B, T) bool tensor, the
    same as a tensor (a compiled forward: no value its graph would be specialized on)."""
    gate = getattr(model, GATE_ATTR, None)
    if gate is None:
        yield
        return
    before, gate.told = gate.told, (rows,)
    try:
        yield
    finally:
        gate.told = before


def install_gate(model, mask_id: int) -> Gate:
    """The model's gate (one per model), set by every forward from its input ids."""
    gate = getattr(model, GATE_ATTR, None)
    if gate is None:
        gate = Gate(mask_id)
        model.get_input_embeddings().register_forward_pre_hook(
            lambda module, args: gate.set(args[0]) if args else None
        )
        object.__setattr__(model, GATE_ATTR, gate)  # a plain attribute, not a submodule
    return gate


def attach(model, tensors: dict[str, torch.Tensor], mask_id: int) -> Gate:
    """Adds the saved deltas to the named linear layers on mask rows: out += B(A(x)) (scaling
    folded into B). tensors: '<module name>.lora_A' (r, in) and '<module name>.lora_B' (out, r)."""
    gate = install_gate(model, mask_id)
    modules = dict(model.named_modules())
    names = sorted({key.rsplit(".", 1)[0] for key in tensors})
    missing = [n for n in names if n not in modules]
    if missing:
        raise ValueError(
            f"{ADAPTER_FILE} names layers this model does not have "
            f"({', '.join(missing[:3])}, ...): it belongs to another model; re-export."
        )
    for name in names:
        layer = modules[name]
        weight = layer.weight
        # A as saved (r, in): the rows the C call (panel.lora_add) takes dot products with; B
        # transposed (r, out), so its rows are what each mask row adds a multiple of. On CPU
        # in fp32 whatever the model's dtype: a bf16 product of these thin matrices costs more there
        # than converting the mask rows (SmolLM2-135M in bf16, a step with 16 mask slots:
        # bench/LOG.md, "bf16 adapters in fp32, and trees at every depth").
        dtype = (
            torch.float32
            if weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
            else weight.dtype
        )
        layer.register_buffer(
            LORA_A,
            tensors[f"{name}.lora_A"].to(weight.device, dtype).contiguous(),
            persistent=False,
        )
        layer.register_buffer(
            LORA_BT,
            tensors[f"{name}.lora_B"].t().to(weight.device, dtype).contiguous(),
            persistent=False,
        )
        # kernels.packed_forward adds the delta itself, the hook set aside
        object.__setattr__(layer, LORA_GATE, gate)

        def hook(module, args, out):
            if gate.open:
                return gate.add(out, args[0], module.tidar_lora_A, module.tidar_lora_Bt)

        setattr(hook, DELTA_HOOK, True)
        layer.register_forward_hook(hook)
    return gate


def ensure(model) -> None:
    """Attach an export's mask-slot adapter once, if its TiDAR spec names one (spec.TiDARSpec:
    `adapter`), from the folder or hub repo the model was loaded from."""
    tidar = TiDARSpec.from_config(model.config)
    if tidar is None or not tidar.mask_scoped or getattr(model, GATE_ATTR, None) is not None:
        return
    from safetensors.torch import load_file
    from transformers.utils import cached_file

    file = tidar.adapter["file"]
    source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    path = cached_file(source, file) if source else None
    if path is None:
        raise FileNotFoundError(
            f"this export's drafts need {file} (config.json: tidar.adapter), which was not found "
            f"beside the model ({source!r}); copy the whole export folder, or pass tidar=False for "
            "plain AR decoding."
        )
    attach(model, load_file(path), tidar.mask_token_id)
