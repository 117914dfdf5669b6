"""Layers with recurrent state (linear attention, state-space, short convolutions) under the TiDAR
layout: docs/method.md §6.

A recurrent layer takes no attention mask to restrict, so the layout reaches it as `Segments`: the
first `causal` slots of a forward continue the state before it (the clean half in training; the
prompt, or the step's drafts, at decode); then groups of `length` mask slots, group g starting from
the state after causal slot anchors[g] - 1 (anchor 0: the state before the forward), exactly as if
it continued the causal slots there. Inside a group the layer runs causally. So a mask block never
reads the clean tokens at or past its own positions (no leak), and a group drafts from the state the
commit will keep.

The layer kind is the mixer: a module with a `layer_idx` whose forward is `(hidden_states, cache,
attention_mask, ...)` and keeps its state through the cache (get/update_conv_state,
get/update_recurrent_state). Every such mixer transformers ships (gated delta nets, Mamba 1 and 2,
short convolutions, Kimi's delta attention) does, so one wrapper serves them all (`layout`):
- causal slots, decoding: one call on the real cache, which records the state after each slot
  (transformers' past recording); `keep_states` then keeps each row's state at its accepted
  length, and nothing is re-run.
- causal slots, training (no cache): one call per piece between anchors, each carrying the last
  one's state, on a cache of its own (`Seeded`) that keeps the autograd graph.
- groups: one call on all groups at once, a batch of short sequences seeded with their anchors'
  states and convolution windows.
- causal slots of a tree (siblings; decoding): one call per depth, each slot a one-token row
  seeded with its parent's state and window as a group is with its anchor's (`_run_tree`); the
  states it reaches are recorded as a chain's are, so `keep_states` keeps a branch by its path.
- a gated delta net built like Qwen3.5's or Qwen3-Next's takes a decode step in one pass instead
  (`gated_delta_step`): the same arithmetic without the groups' second mixer call.

Shipped in every export: imports nothing but torch and transformers.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from .cache import GrowingLayer
from .transfer import on_device

try:
    from transformers.cache_utils import DummyLayer
except ImportError:  # an older transformers (5.17): an empty layer holds a place in a Cache too
    DummyLayer = DynamicLayer

try:
    from transformers.cache_utils import (
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionAndSlidingWindowAttentionLayer,
        LinearAttentionCacheLayerMixin,
        LinearAttentionLayer,
    )
except ImportError:  # a transformers before hybrid caches (5.17: test_export's older one): no cache
    # layer there holds recurrent state, so every check below finds none

    class LinearAttentionCacheLayerMixin:
        pass

    LinearAttentionLayer = LinearAttentionAndFullAttentionLayer = LinearAttentionCacheLayerMixin
    LinearAttentionAndSlidingWindowAttentionLayer = LinearAttentionCacheLayerMixin


@dataclass(frozen=True)
class Segments:
    """How one forward's slots run through a recurrent layer (module docstring)."""

    causal: int
    anchors: tuple[int, ...] = ()
    length: int = 0
    # (B, causal) False at left padding (the mixer zeroes those inputs, as with a 2D mask)
    valid: torch.Tensor | None = None
    # decoding: the state after every causal slot, so that `keep_states` can keep any of them
    record: bool = False
    # training: the causal slots run in pieces on a cache of their own (any cache the model made
    # for the call is left alone)
    pieces: bool = False
    # decoding a tree (greedy, batch 1; StepPlan.parents): each causal slot's parent slot (-1: the
    # cache), whose state it continues; None: a chain. Anchors count as on a chain: the group
    # anchored at a starts from the state after slot a - 1 and its ancestors.
    parents: tuple[int, ...] | None = None

    @classmethod
    def training(cls, seq_len: int, draft_length: int) -> "Segments":
        """[clean | mask]: block b starts from the state after the clean tokens before it."""
        return cls(seq_len, tuple(range(0, seq_len, draft_length)), draft_length, pieces=True)


# How a mixer (a layer kind) continues a state it is given, read from its forward's source
# (`continuation`):
# - CHUNKED: its multi-token forward starts from the cached state, and records the state after
#   each of its last tokens when the cache asks (`get_recurrent_states_to_keep`).
# - STEPWISE: its multi-token scan starts from zero whatever the cache holds (transformers' Mamba 1
#   `mamba_selective_scan` takes no initial state); the form that records states, token by token,
#   reads the cache. A seeded call asks it to record every token.
# - ONE_TOKEN: only its one-token forward reads the cache, and it records nothing (Zamba's
#   per-head scans): a seeded call runs one token per call.
CHUNKED, STEPWISE, ONE_TOKEN = "chunked", "stepwise", "one token"
SCANS_FROM_ZERO = frozenset({"MambaMixer", "FalconMambaMixer", "JambaMambaMixer"})
# Enough for any mixer transformers ships (one, or two for a second short convolution).
MOST_STATES = 4
# What a mixer's forward calls to keep its state in the cache.
STATE_CALLS = re.compile(
    r"\b(get_conv_state|update_conv_state|get_recurrent_state|update_recurrent_state"
    r"|causal_conv1d_forward)\b"
)


def keeps_state(module) -> bool:
    """Whether the module's forward reads or writes recurrent state in the cache."""
    try:
        return bool(STATE_CALLS.search(inspect.getsource(type(module).forward)))
    except (OSError, TypeError):
        return False


def is_mixer(module) -> bool:
    """A layer with recurrent state, as the layout reaches it: forward(hidden_states, cache,
    attention_mask, ...) that keeps its state through the cache."""
    return hasattr(module, "layer_idx") and continuation(type(module)) is not None


@functools.cache
def continuation(cls) -> str | None:
    """CHUNKED, STEPWISE or ONE_TOKEN for a mixer class (see above); None for any other module."""
    forward = cls.forward
    try:
        params = list(inspect.signature(forward).parameters)
        source = inspect.getsource(forward)
    except (OSError, TypeError, ValueError):
        return None
    if params[1:4] != ["hidden_states", "cache", "attention_mask"] or not STATE_CALLS.search(
        source
    ):
        return None
    if any(c.__name__ in SCANS_FROM_ZERO for c in cls.__mro__):  # a wrapper's subclass too
        return STEPWISE
    if "get_recurrent_state" in source and "get_recurrent_states_to_keep" not in source:
        return ONE_TOKEN
    return CHUNKED


def mixers(model) -> list:
    """The model's recurrent mixers, in layer order: the innermost modules that are `is_mixer` (a
    decoder block may have the same signature as the mixer it holds)."""
    found = [m for m in model.modules() if is_mixer(m)]
    return [m for m in found if not any(o is not m for o in m.modules() if o in found)]


def outside_mixers(model) -> list:
    """Modules that keep state through the cache but are neither a mixer nor inside one (a short
    convolution inside an attention projection): the layout cannot reach them."""
    inside = {id(sub) for m in mixers(model) for sub in m.modules()}
    return [m for m in model.modules() if id(m) not in inside and keeps_state(m)]


@contextlib.contextmanager
def layout(model_or_mixers, segments: Segments | None):
    """For the duration of one forward, every mixer runs `segments` (None: unchanged)."""
    found = model_or_mixers if isinstance(model_or_mixers, list) else mixers(model_or_mixers)
    if segments is None or not found:
        yield
        return
    # a layout inside another (a decode inside a fit's validation) puts the outer one back
    before = [m.__dict__.get("forward") for m in found]
    for m in found:
        m.forward = _segmented(m, segments)
    try:
        yield
    finally:
        for m, previous in zip(found, before):
            if previous is None:
                del m.forward
            else:
                m.forward = previous


def _segmented(mixer, seg: Segments):
    original = type(mixer).forward.__get__(mixer)

    def forward(hidden_states, cache=None, attention_mask=None, **kwargs):
        B, Q, D = hidden_states.shape
        T, k, G = seg.causal, seg.length, len(seg.anchors)
        if Q != T + G * k:
            raise ValueError(
                f"a recurrent layer got {Q} slots for {T} causal slots and {G} groups of {k}"
            )
        if is_gated_delta(mixer) and not seg.pieces and seg.record and cache is not None:
            layer = cache.layers[mixer.layer_idx]
            if _began(layer):
                return gated_delta_step(mixer, hidden_states, layer, seg)
        x = hidden_states[:, :T]
        kind = continuation(type(mixer))
        if seg.parents is not None and (seg.pieces or cache is None):
            raise ValueError("a tree of causal slots (Segments.parents) is a decode step's only")
        if seg.pieces or cache is None:
            y, seeds = _run_pieces(original, mixer.layer_idx, x, seg, kwargs, kind)
        elif seg.parents is not None:
            y, seeds = _run_tree(original, mixer.layer_idx, x, cache, seg, kwargs, kind)
        else:
            y, seeds = _run_recorded(original, mixer.layer_idx, x, cache, seg, kwargs, kind)
        if not G:
            return y
        groups = hidden_states[:, T:].reshape(B * G, k, D)
        layer = Seeded.of(seeds, B, G, kind)
        if not seg.pieces:
            # decoding: a group is a few tokens, which the token-by-token form runs faster than a
            # chunked scan padded to its chunk (64 tokens in the gated delta rule)
            layer.recurrent_states_to_keep = k
        seeded = Cache(layers=_placeholders(mixer.layer_idx) + [layer])
        out = _continue(original, groups, seeded, layer, None, kwargs, kind)
        rest = _first(out).reshape(B, G * k, -1)
        return _replace_first(y, torch.cat([_first(y), rest], 1))

    return forward


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _replace_first(out, value):
    return (value, *out[1:]) if isinstance(out, tuple) else value


def _placeholders(n: int) -> list:
    return [DummyLayer() for _ in range(n)]


def _mask(seg: Segments, start: int, stop: int):
    return None if seg.valid is None else seg.valid[:, start:stop].to(torch.long)


def _continue(original, x, cache, layer, mask, kwargs, kind: str, record: bool = False):
    """One mixer call over x that continues the state `layer` holds: a ONE_TOKEN kind runs one
    token per call (recording the state after each where `record`: it records nothing itself),
    any other kind one call."""
    if kind != ONE_TOKEN or not _began(layer):
        return original(x, cache=cache, attention_mask=mask, **kwargs)
    T = x.shape[1]
    held = [i for i in _states_of(layer) if layer.is_recurrent_states_initialized[i]]
    history = {i: [layer.recurrent_states[i].clone()] for i in held}
    outs = []
    for t in range(T):
        step_mask = None if mask is None else mask[:, t : t + 1]
        outs.append(original(x[:, t : t + 1], cache=cache, attention_mask=step_mask, **kwargs))
        if record and t < T - 1:
            for i in held:  # its one-token form updates the state in place
                history[i].append(layer.recurrent_states[i].clone())
    if record:
        layer.recurrent_states_history = {i: history.get(i, []) for i in _states_of(layer)}
    return _replace_first(outs[0], torch.cat([_first(o) for o in outs], 1))


class Seeded(LinearAttentionLayer):
    """A cache layer of one mixer call: seeded with given states, never writing in place (so
    autograd can take gradients through it), and recording whatever the call writes.

    kind: the mixer's `continuation`. A STEPWISE or ONE_TOKEN mixer continues a seeded state token
    by token, a form that updates the state in place; holding the state in float64 makes each step
    read a float32 copy of it, so autograd keeps the values it needs (the values are those of the
    float32 steps: each is computed in float32).
    """

    def __init__(self, kind: str = CHUNKED):
        super().__init__(number_of_states=MOST_STATES)
        self.kind = kind
        self.record_past = True
        self.recurrent_states_to_keep = 0
        self.recurrent_states_history = {i: [] for i in range(MOST_STATES)}

    @classmethod
    def of(cls, seeds: dict, batch: int, groups: int, kind: str = CHUNKED) -> "Seeded":
        """seeds: state index -> (conv windows, recurrent states), each (G, B, ...) or None: one
        sequence per (row, group), row-major as the groups' slots are laid out."""
        layer = cls(kind)
        for i, (conv, rec) in seeds.items():
            if conv is not None:
                layer.conv_states[i] = conv.transpose(0, 1).reshape(-1, *conv.shape[2:])
                layer.conv_kernel_size[i] = conv.shape[-1]
                layer.is_conv_states_initialized[i] = True
                layer.dtype, layer.device = conv.dtype, conv.device
            if rec is not None:
                # its own copy: a ONE_TOKEN mixer writes it in place
                layer.recurrent_states[i] = rec.transpose(0, 1).reshape(-1, *rec.shape[2:]).clone()
                layer.is_recurrent_states_initialized[i] = True
            layer.has_previous_state[i] = conv is not None or rec is not None
        layer.seeded()
        return layer

    def seeded(self) -> None:
        """The layer now holds a state that the next call continues."""
        if self.kind == CHUNKED:
            return
        if self.kind == STEPWISE:
            self.recurrent_states_to_keep = 2**62  # every token of the call: the stepwise form
        if torch.is_grad_enabled():
            for i in range(MOST_STATES):
                if self.is_recurrent_states_initialized[i]:
                    self.recurrent_states[i] = self.recurrent_states[i].double()

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs):
        if not isinstance(recurrent_states, torch.Tensor):
            recurrent_states = recurrent_states[-1]
        self.recurrent_states[state_idx] = recurrent_states
        self.is_recurrent_states_initialized[state_idx] = True
        return recurrent_states


def _states_of(layer) -> range:
    return range(layer.number_of_states)


def _run_pieces(original, layer_idx: int, x, seg: Segments, kwargs, kind: str = CHUNKED):
    """Training: the causal slots in pieces that end at the anchors; the state and convolution
    window at each anchor."""
    T = seg.causal
    bounds = sorted({a for a in seg.anchors if 0 < a < T} | {T})
    layer = Seeded(kind)
    cache = Cache(layers=_placeholders(layer_idx) + [layer])
    outs, at, start = [], {}, 0
    for stop in bounds:
        out = _continue(
            original, x[:, start:stop], cache, layer, _mask(seg, start, stop), kwargs, kind
        )
        outs.append(out)
        at[stop] = _state_after(layer, 0, 0)  # the state and window the piece ended with
        layer.seeded()
        start = stop
    y = _replace_first(outs[0], torch.cat([_first(o) for o in outs], 1))
    return y, _seeds(seg.anchors, at)


def _window(full: torch.Tensor, K: int) -> torch.Tensor:
    """The last K columns, zeros on the left where fewer were seen."""
    if full.shape[-1] < K:
        full = torch.nn.functional.pad(full, (K - full.shape[-1], 0))
    return full[..., -K:]


def _stack(snaps: list) -> dict:
    """state index -> (conv windows, states), each stacked (N, B, ...) over N snapshots
    (`_state_after`'s, all of the same states): the seeds `Seeded.of` takes."""

    def stacked(i, j):
        return None if snaps[0][i][j] is None else torch.stack([snap[i][j] for snap in snaps])

    return {i: (stacked(i, 0), stacked(i, 1)) for i in snaps[0]}


def _seeds(anchors, at: dict) -> dict:
    """`_stack` over the anchors' snapshots; anchor 0 (nothing before it) gets zeros, which is
    what a fresh state and a fresh window are."""
    some = next(iter(at.values()))
    zeros = {
        i: tuple(None if t is None else torch.zeros_like(t) for t in pair)
        for i, pair in some.items()
    }
    return _stack([zeros if a == 0 else at[a] for a in anchors])


def _run_recorded(original, layer_idx: int, x, cache, seg: Segments, kwargs, kind: str = CHUNKED):
    """Decoding: the causal slots on the real cache in one call, recording the state after each
    (seg.record), or only the last (prefill)."""
    T = seg.causal
    layer = cache.layers[layer_idx]
    start_recording(layer, T if seg.record else 0)
    out = _continue(original, x, cache, layer, _mask(seg, 0, T), kwargs, kind, seg.record)
    at = {a: _state_after(layer, a, T) for a in set(seg.anchors)}
    return out, (_seeds(seg.anchors, at) if at else {})


def _levels(parents) -> list[list[int]]:
    """A tree's slots by depth (parents before children, -1: the cache): each level's parents all
    lie in the levels before it."""
    depth = {-1: -1}
    for slot, parent in enumerate(parents):
        depth[slot] = depth[parent] + 1
    return [
        [s for s in range(len(parents)) if depth[s] == level]
        for level in range(max(depth.values()) + 1)
    ]


def _run_tree(original, layer_idx: int, x, cache, seg: Segments, kwargs, kind: str = CHUNKED):
    """Decoding a tree (seg.parents): a scan over the causal slots in order would run each sibling
    from its left neighbour's state, so the slots run depth by depth instead, one call per depth:
    each slot one token, a batch row of its own, seeded with its parent's state and window as a
    group is with its anchor's (`Seeded`). The real layer is then left as a chain's recording
    leaves it (`_record_tree`), so keep_states keeps a branch by its path, and a group anchored
    after any slot starts from that slot's state."""
    B, T, D = x.shape
    layer = cache.layers[layer_idx]
    start_recording(layer, T)
    after = {-1: _state_after(layer, 0, 0)}  # slot -> its state and window, (B, ...) each
    outs = [None] * T
    for slots in _levels(seg.parents):
        L = len(slots)
        level = Seeded.of(_stack([after[seg.parents[s]] for s in slots]), B, L, kind)
        seeded = Cache(layers=_placeholders(layer_idx) + [level])
        inputs = x[:, slots].reshape(B * L, 1, D)  # row b * L + l, as Seeded.of lays out seeds
        mask = None if seg.valid is None else seg.valid[:, slots].reshape(B * L, 1).long()
        out = _continue(original, inputs, seeded, level, mask, kwargs, kind)
        y = _first(out).reshape(B, L, -1)
        for row, (slot, snap) in enumerate(zip(slots, _split(_state_after(level, 1, 1), B, L))):
            outs[slot], after[slot] = y[:, row], snap
    _record_tree(layer, after, T)
    at = {a: after[a - 1] for a in set(seg.anchors)}
    return _replace_first(out, torch.stack(outs, 1)), (_seeds(seg.anchors, at) if at else {})


def _split(snap: dict, B: int, L: int) -> list:
    """A snapshot of B * L rows (row b * L + l) as L snapshots of B rows."""
    return [
        {
            i: tuple(None if t is None else t.unflatten(0, (B, L))[:, row] for t in pair)
            for i, pair in snap.items()
        }
        for row in range(L)
    ]


def _record_tree(layer, after: dict, T: int) -> None:
    """The layer as a recording call over T chain slots leaves it, for keep_states and the
    groups: the window before the step, then each slot's convolution input (the last column of
    its window) in slot order; the state after each slot, in slot order."""
    for i, (conv, rec) in after[-1].items():
        if conv is not None:
            inputs = [after[s][i][0][..., -1:].to(conv.dtype) for s in range(T)]
            layer.conv_states[i] = torch.cat([conv, *inputs], -1)
        if rec is not None:
            states = [rec] + [after[s][i][1].to(rec.dtype) for s in range(T)]
            layer.recurrent_states_history[i] = states[:-1]
            layer.recurrent_states[i] = states[-1]
    layer.cumulative_length_linear = layer.cumulative_length_linear + T


def _began(layer) -> bool:
    return any(layer.has_previous_state.values())


def start_recording(layer, keep: int) -> None:
    """Before a forward: the layer keeps the state after each of its last `keep` slots (and, as
    recording does, the whole convolution input) until `keep_states`."""
    layer.record_past = True
    layer.recurrent_states_to_keep = keep
    # one list per state (transformers' dict.fromkeys would share a single list among them)
    layer.recurrent_states_history = {i: [] for i in _states_of(layer)}
    for i in _states_of(layer):
        if layer.is_conv_states_initialized[i] and layer.conv_kernel_size[i] is not None:
            layer.conv_states[i] = layer.conv_states[i][..., -layer.conv_kernel_size[i] :]


def _states(layer, i: int) -> list:
    """The recurrent states this forward recorded, ending with the current one."""
    return list(layer.recurrent_states_history[i]) + [layer.recurrent_states[i]]


def _state_after(layer, n: int, T: int) -> dict:
    """state index -> (conv window, recurrent state) after the first n of this forward's T causal
    slots (n = T = 0: as the layer holds them now), for the states the layer holds."""
    snap = {}
    for i in _states_of(layer):
        conv = rec = None
        if layer.is_conv_states_initialized[i]:
            K = layer.conv_kernel_size[i]
            full = layer.conv_states[i]  # the window before, then the T new inputs
            conv = _window(full[..., : full.shape[-1] - (T - n)], K)
        if layer.is_recurrent_states_initialized[i]:
            states = _states(layer, i)
            index = n - T + len(states) - 1
            if index < 0:
                raise RuntimeError(f"no recorded state after slot {n} of {T}")
            # the live one copied: a STEPWISE or ONE_TOKEN mixer goes on to write it in place
            rec = states[index] if index < len(states) - 1 else states[index].clone()
        if conv is not None or rec is not None:
            snap[i] = (conv, rec)
    return snap


def recurrent_layers(cache) -> list:
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def keep_states(cache, causal: int, kept: torch.Tensor, path: list[int] | None = None) -> None:
    """After a forward of `causal` causal slots: each row b's recurrent layers keep the state after
    its first kept[b] slots (kept: (B,) long), and their convolution windows end there. A tree's
    branch (batch 1) is `path`, the kept slots root first: the state after its last slot, the
    window along it. The attention half of a hybrid cache layer is cropped by the caller."""
    for layer in recurrent_layers(cache):
        if not _began(layer):
            continue
        rows = torch.arange(kept.shape[0], device=kept.device)
        # a state index per row into [before the step, after slot 0, after slot 1, ...]
        index = kept if path is None else on_device([path[-1] + 1 if path else 0], kept.device)
        for i in _states_of(layer):
            if layer.is_conv_states_initialized[i]:
                K = layer.conv_kernel_size[i]
                full = _window(layer.conv_states[i], K + causal)  # (B, C, K + T)
                if path is None:  # window ends at kept - 1
                    cols = (kept[:, None] + torch.arange(K, device=kept.device)).to(full.device)
                else:  # the cached window, then the path's inputs: the last K of them
                    cols = on_device([([*range(K)] + [K + s for s in path])[-K:]], full.device)
                layer.conv_states[i] = full.gather(
                    -1, cols[:, None, :].expand(-1, full.shape[1], -1)
                ).contiguous()
            if layer.is_recurrent_states_initialized[i]:
                states = _states(layer, i)
                stacked = torch.stack(states[-(causal + 1) :]) if len(states) > causal else None
                if stacked is None:
                    if not bool((index == causal).all()):
                        raise RuntimeError("a recurrent state was not recorded for keep_states")
                else:  # stacked[n] is the state after n slots (a tree's: after slot n - 1)
                    layer.recurrent_states[i] = stacked[index.to(rows.device), rows].contiguous()
            layer.recurrent_states_history[i] = []
        layer.cumulative_length_linear = layer.cumulative_length_linear - (causal - kept.max())


def crop_attention(cache, tokens: int) -> None:
    """Crop the attention half of each layer by `tokens` (the recurrent half: `keep_states`)."""
    if tokens <= 0:
        return
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionAndFullAttentionLayer):
            DynamicLayer.crop(layer, -tokens)  # its own crop would crop the recurrent half too
        elif not isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.crop(-tokens)


def select_rows(cache, rows: torch.Tensor) -> None:
    """Keep only `rows` of the batch in every layer, recurrent halves included."""
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            LinearAttentionCacheLayerMixin.reorder_cache(layer, rows)
            if isinstance(layer, DynamicLayer):
                DynamicLayer.batch_select_indices(layer, rows)
        else:
            layer.batch_select_indices(rows)


def new_cache(config):
    """The decoding cache of a model with recurrent layers: transformers' hybrid cache, but every
    attention layer keeps its whole past (the layout's masks apply sliding windows, and the engine
    crops by slot counts)."""
    cache = DynamicCache(config=config)
    for idx, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionAndSlidingWindowAttentionLayer):
            cache.layers[idx] = LinearAttentionAndFullAttentionLayer(
                number_of_states=layer.number_of_states
            )
        elif isinstance(layer, DynamicSlidingWindowLayer) or type(layer) is DynamicLayer:
            cache.layers[idx] = GrowingLayer()
    return cache


# --------------------------------------------------------------------------------------------
# A decode step of Qwen3.5's gated delta net in one pass (its layout, not a second mixer call).
# --------------------------------------------------------------------------------------------

# A gated delta net's projections, either separate (Qwen3.5) or fused in two (Qwen3-Next, split by
# its own fix_query_key_value_ordering); then one depthwise convolution, A_log and dt_bias.
GATED_DELTA_PROJECTIONS = (
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering"),
)
GATED_DELTA = ("conv1d", "A_log", "dt_bias", "norm", "out_proj")


def is_gated_delta(mixer) -> bool:
    """A gated delta net built like Qwen3.5's or Qwen3-Next's: q/k/v, z, b and a projections
    (GATED_DELTA_PROJECTIONS), one depthwise convolution, a gated RMS norm, SiLU."""
    return (
        any(all(hasattr(mixer, n) for n in names) for names in GATED_DELTA_PROJECTIONS)
        and all(hasattr(mixer, name) for name in GATED_DELTA)
        and getattr(mixer, "activation", None) == "silu"
    )


def _gated_delta_projections(mixer, x: torch.Tensor) -> tuple:
    """(q|k|v before the convolution (B, Q, C), z (B, Q, H, dv), b (B, Q, H), a (B, Q, H)), as the
    mixer's own forward computes them."""
    B, Q, _ = x.shape
    if hasattr(mixer, "in_proj_qkv"):
        z = mixer.in_proj_z(x).reshape(B, Q, -1, mixer.head_v_dim)
        return mixer.in_proj_qkv(x), z, mixer.in_proj_b(x), mixer.in_proj_a(x)
    q, k, v, z, b, a = mixer.fix_query_key_value_ordering(
        mixer.in_proj_qkvz(x), mixer.in_proj_ba(x)
    )
    return torch.cat([t.reshape(B, Q, -1) for t in (q, k, v)], -1), z, b, a


def _delta_rule(state, q, k, v, beta, g, out) -> list[torch.Tensor]:
    """torch_recurrent_gated_delta_rule's update token by token over (B, H, n, d) inputs from
    `state` (B, H, dk, dv), writing the outputs into `out` and returning the state after each
    token. Its products over dk run as batched matrix products, four kernels a token: its
    broadcast-and-sum form takes nine and makes three state-sized temporaries, which at decode's
    few slots cost more than the arithmetic."""
    B, H, n, dk = q.shape
    dv = v.shape[-1]

    def per_token(t):  # (B, H, n, d) -> (n, B * H, 1, d), each token's slice contiguous
        return t.permute(2, 0, 1, 3).reshape(n, B * H, 1, -1)

    decay, beta = (per_token(t[..., None]) for t in (g.exp(), beta))
    k, q = per_token(k), per_token(q)
    k_beta, v_beta = k * beta, per_token(v) * beta
    k_t = k.transpose(-1, -2)
    outs = torch.empty(n, B * H, 1, dv, dtype=v.dtype, device=v.device)
    state = state.reshape(B * H, dk, dv)
    states = []
    for i in range(n):
        state = state * decay[i]
        delta = torch.baddbmm(v_beta[i], k_beta[i], state, alpha=-1)  # (v - k S) beta
        state = torch.addcmul(state, k_t[i], delta)
        torch.bmm(q[i], state, out=outs[i])
        states.append(state.view(B, H, dk, dv))
    out.copy_(outs.reshape(n, B, H, dv).permute(1, 2, 0, 3))
    return states


@functools.lru_cache(maxsize=256)
def _conv_windows(T: int, anchors: tuple, k: int, K: int, parents, device) -> torch.Tensor:
    """(Q, K) columns of [cached window (K) | this step's Q inputs] that each slot's convolution
    reads: a causal slot the K inputs ending at itself along its ancestors (a chain's: the slots
    before it); token j of the group anchored at a its own inputs so far after the K inputs
    ending at slot a - 1, as if the group continued there."""
    parents = tuple(range(-1, T - 1)) if parents is None else parents
    paths = {-1: list(range(K))}  # slot -> the input columns up to it: the cached window first
    for slot in range(T):
        paths[slot] = paths[parents[slot]] + [K + slot]
    rows = [paths[slot][-K:] for slot in range(T)]
    for g, a in enumerate(anchors):
        start = K + T + g * k  # the group's first input
        rows += [(paths[a - 1] + list(range(start, start + j + 1)))[-K:] for j in range(k)]
    return on_device(rows, torch.device(device), torch.long)


def _delta_tree(state, q, k, v, beta, g, out, parents) -> list[torch.Tensor]:
    """`_delta_rule` over a tree of T slots (batch 1): each slot continues its parent's state,
    the slots of one depth as one batch. Returns the state after each slot, in slot order."""
    after = {-1: state}
    for slots in _levels(parents):
        seeds = torch.cat([after[parents[s]] for s in slots])  # (L, H, dk, dv)

        def pick(t):  # (1, H, T, ...) -> (L, H, 1, ...): each slot of the level as a row
            return t[0][:, slots].transpose(0, 1).unsqueeze(2)

        level_out = out.new_empty(len(slots), out.shape[1], 1, out.shape[-1])
        (states,) = _delta_rule(seeds, pick(q), pick(k), pick(v), pick(beta), pick(g), level_out)
        for row, slot in enumerate(slots):
            after[slot] = states[row : row + 1]
            out[0, :, slot] = level_out[row, :, 0]
    return [after[slot] for slot in range(len(parents))]


def _delta_chunk(state, q, k, v, beta, g) -> torch.Tensor:
    """The rule's outputs over n tokens from `state` (inputs as `_delta_rule`'s), without the
    states between them: torch_chunk_gated_delta_rule's one-chunk (WY) form with a chunk of n,
    which reads the state twice where the token loop rewrites it twice a token."""
    n = q.shape[2]
    cum = g.cumsum(-1)  # (N, H, n): log decay from the start to each token
    later = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(later, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strict lower part, with a unit diagonal
    solve = functools.partial(torch.linalg.solve_triangular, upper=False, unitriangular=True)
    new_values = solve(system, v_beta) - solve(system, k_beta * cum.exp()[..., None]) @ state
    attention = (q @ k.transpose(-1, -2)) * decay
    return (q * cum.exp()[..., None]) @ state + attention @ new_values


def gated_delta_step(mixer, hidden_states, layer, seg: Segments) -> torch.Tensor:
    """One decode step of a gated delta net under `seg`, computing what the generic path computes
    (the drafts continuing the cached state, each group from the state at its anchor, the state
    after every draft recorded for keep_states) in one pass: the projections and the convolution
    once over all slots, the drafts token by token (`_delta_rule`: the state after each is what
    the commit keeps), the groups as one chunk each (`_delta_chunk`: their states between tokens
    are never kept). The generic path's second mixer call for the groups, and the state-sized
    passes of the token loop over them, cost more than the rest of the step. The arithmetic is
    transformers' (causal_conv1d_update, torch_recurrent_gated_delta_rule and
    torch_chunk_gated_delta_rule) up to the order of its sums."""
    import torch.nn.functional as F

    B, Q, _ = hidden_states.shape
    T, k, G = seg.causal, seg.length, len(seg.anchors)
    dk, dv = mixer.head_k_dim, mixer.head_v_dim
    x = hidden_states
    start_recording(layer, T)
    mixed, z, b, a = _gated_delta_projections(mixer, x)  # mixed: (B, Q, C)
    beta = b.sigmoid()
    g = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)

    # the convolution, over [cached window | this step's inputs] laid out time-major, so that
    # gathering each slot's window of K inputs copies whole rows of channels
    weight, bias = mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias  # (C, K)
    K = weight.shape[-1]
    inputs = torch.cat([layer.conv_states[0][..., -K:].transpose(1, 2), mixed], 1)  # (B, K+Q, C)
    columns = _conv_windows(T, seg.anchors, k, K, seg.parents, x.device)
    windows = inputs[:, columns].to(weight.dtype)
    convolved = (windows * weight.t()).sum(2)  # (B, Q, K, C) -> (B, Q, C)
    if bias is not None:
        convolved = convolved + bias
    mixed = F.silu(convolved).to(mixed.dtype)
    query, key, value = torch.split(mixed, [mixer.key_dim, mixer.key_dim, mixer.value_dim], -1)
    query = query.reshape(B, Q, -1, dk)
    key = key.reshape(B, Q, -1, dk)
    value = value.reshape(B, Q, -1, dv)
    heads = value.shape[2] // key.shape[2]
    if heads > 1:
        query, key = query.repeat_interleave(heads, 2), key.repeat_interleave(heads, 2)
    # (B, H, Q, d) in float32, q and k l2-normed and q scaled: torch_recurrent_gated_delta_rule's
    query, key, value, beta, g = [
        t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for t in (query, key, value, beta, g)
    ]
    query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6)
    key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    query = query / (query.shape[-1] ** 0.5)

    core = torch.zeros_like(value)
    before = layer.recurrent_states[0].to(value)
    rule = (
        _delta_rule if seg.parents is None else functools.partial(_delta_tree, parents=seg.parents)
    )
    states = [before] + rule(
        before, query[:, :, :T], key[:, :, :T], value[:, :, :T], beta[:, :, :T], g[:, :, :T],
        core[:, :, :T],
    )  # fmt: skip

    def grouped_heads(t):  # (B, H, G * k, d) -> (B * G, H, k, d)
        H = t.shape[1]
        return t[:, :, T:].reshape(B, H, G, k, -1).transpose(1, 2).reshape(B * G, H, k, -1)

    if G:
        seeds = torch.stack([states[a] for a in seg.anchors], 1).flatten(0, 1)  # (B*G, H, dk, dv)
        group_out = _delta_chunk(
            seeds, *(grouped_heads(t) for t in (query, key, value)),
            grouped_heads(beta[..., None])[..., 0], grouped_heads(g[..., None])[..., 0],
        )  # fmt: skip
        H = core.shape[1]
        core[:, :, T:] = group_out.reshape(B, G, H, k, dv).transpose(1, 2).reshape(B, H, G * k, dv)
    core = core.transpose(1, 2).contiguous().to(hidden_states.dtype)  # (B, Q, H, dv)

    # the cache as the generic path leaves it: keep_states picks each row's draft count
    layer.conv_states[0] = inputs[:, : K + T].transpose(1, 2)  # (B, C, K + T)
    layer.recurrent_states_history[0] = states[:-1]
    layer.recurrent_states[0] = states[-1]
    layer.cumulative_length_linear = layer.cumulative_length_linear + T

    out = mixer.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(B, Q, -1)
    return mixer.out_proj(out)
