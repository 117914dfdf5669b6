"""A model's decoding session: everything TiDAR decoding keeps between generate() calls, in one
object, so that nothing of it hides in module globals or in stray attributes of the model.

Lifetime: the first generate() on a model makes it (`session_of`) and keeps it on the model as
`model.tidar_session`, a plain attribute (not a submodule: it is never saved, moved or copied with
the weights). It lives as long as the model, or until `reset()`.

What it holds, and why each is kept rather than made again per call:
- `costs`: the step-cost tables (costs.StepCosts), one per setting (kernels, dtype, device, batch
  size): the cost planner prices step shapes from what they took on this model and machine, and
  learning them takes a call's worth of steps.
- `own_masks`: the (Q, Q) attention block among a step's own query slots, by plan
  (layout.decode_step_mask): it depends on the plan alone, and plans repeat.
- `mixers`: the model's layers with recurrent state (recurrent.mixers): finding them reads their
  classes' source.
- `static_caches`, `compiled`: for cache_implementation="static" (slots.py), the static KV cache
  of each shape and the decoder body's compiled call: a compiled graph is tied to its cache's
  buffers (on a GPU, a CUDA graph to their addresses), so a new cache each call would compile
  again.
- `kernels`: which product each linear layer takes, the packed copies of its weight, the packed
  mask-slot deltas and the timing that chose them (kernels.py): packing costs a pass over every
  weight, and timing the products another few.

`reset()` forgets all of it: the next generate() measures and packs afresh, as the first call on a
fresh model does. No output depends on any of it (every plan and every product gives the same
tokens, sampled ones included); the speed and the T/NFE of the calls that follow do, so a caller
comparing runs (a benchmark, a test of the planner) resets between them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from .costs import StepCosts

ATTR = "tidar_session"
OWN_MASKS_KEPT = 512  # plans vary with the draft length and anchors: the memory stays bounded


@dataclass
class KernelState:
    """The CPU kernels' per-layer choices and copies (kernels.py), keyed by the layer module."""

    packed: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    chosen: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    delta_panels: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    # (weights key, whether packing pays, the timings that said so): kernels.packing_pays
    timing: tuple | None = None


class Session:
    def __init__(self):
        self.costs: dict[tuple, StepCosts] = {}
        self.own_masks: dict = {}
        self.kernels = KernelState()
        self.mixers: list | None = None
        self.static_caches: dict = {}
        self.compiled: dict = {}

    def recurrent_mixers(self, model) -> list:
        """The model's recurrent mixers (recurrent.mixers), found on first use."""
        if self.mixers is None:
            from .recurrent import mixers

            self.mixers = mixers(model)
        return self.mixers

    def step_costs(self, setting: tuple = ()) -> StepCosts:
        """The step-cost table of one setting (whatever changes what a step shape costs)."""
        return self.costs.setdefault(setting, StepCosts())

    def own_mask(self, key, make):
        """The cached own-query mask block of a plan, made by `make()` the first time."""
        mask = self.own_masks.get(key)
        if mask is None:
            if len(self.own_masks) >= OWN_MASKS_KEPT:
                self.own_masks.clear()
            mask = self.own_masks[key] = make()
        return mask

    def static_cache(self, key, make):
        """The static cache of one shape (batch, length, dtype, device), made the first time; only
        the last shape is kept (each holds a whole KV cache)."""
        if key not in self.static_caches:
            self.static_caches.clear()
            self.static_caches[key] = make()
        return self.static_caches[key]

    def compiled_call(self, key, make):
        """A compiled call, made (torch.compile: lazy, it compiles on first call) the first time."""
        if key not in self.compiled:
            self.compiled[key] = make()
        return self.compiled[key]

    def __deepcopy__(self, memo):
        # a copied model's layers are new objects, and a packed copy may be an opaque oneDNN
        # tensor that cannot be copied: the copy starts a session of its own
        return Session()

    def __reduce__(self):
        return (Session, ())  # pickled (torch.save of a whole model) as a fresh session

    def reset(self) -> None:
        """Forget step costs, mask blocks and kernel choices; packed weight copies are freed."""
        self.costs.clear()
        self.own_masks.clear()
        self.kernels = KernelState()
        self.mixers = None
        self.static_caches.clear()
        self.compiled.clear()


def session_of(model) -> Session:
    """The model's session, made on first use."""
    session = model.__dict__.get(ATTR)
    if session is None:
        session = Session()
        object.__setattr__(model, ATTR, session)  # not a submodule: torch.nn.Module keeps out
    return session


def reset(model) -> None:
    """Forget what decoding learned on `model` (Session.reset); a model never decoded is
    unchanged."""
    session = model.__dict__.get(ATTR)
    if session is not None:
        session.reset()
