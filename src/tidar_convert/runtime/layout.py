"""The TiDAR layout: who attends to whom, at which positions, predicting what.

This is the only file that defines the layout. Training and decoding both build their attention
from a `mask_mod(b, h, q, kv) -> bool` here; `to_dense` evaluates it for SDPA (CPU, and any
backend without FlexAttention backward), `to_block_mask` turns it into a FlexAttention BlockMask.

Shipped verbatim inside every export (see export.py), so it imports nothing but torch.

Every mask_mod is written with elementwise tensor ops and indexing only, so it works both under
FlexAttention's vmap and when called once with broadcast index grids (`to_dense`).
"""

from __future__ import annotations

import torch

from .spec import check_draft_length
from .transfer import on_device

IGNORE_INDEX = -100


# --------------------------------------------------------------------------------------------
# Training: [x_0 .. x_{S-1} | M .. M], see docs/method.md §1.
# --------------------------------------------------------------------------------------------


def train_mask_mod(seq_len: int, draft_length: int, doc_ids: torch.Tensor | None = None):
    """Clean half causal; masked block b sees the clean prefix before it and itself.

    doc_ids: (B, seq_len) document index per clean token; a query never sees another document.
    The masked slot S + i belongs to the document of clean token i.
    """
    S, k = seq_len, draft_length

    def mask_mod(b, h, q, kv):
        q_clean, kv_clean = q < S, kv < S
        causal = q_clean & kv_clean & (kv <= q)
        q_block, kv_block = (q - S) // k, (kv - S) // k
        sees_prefix = kv_clean & (kv < q_block * k)
        same_block = ~kv_clean & (kv_block == q_block)
        allowed = causal | (~q_clean & (sees_prefix | same_block))
        if doc_ids is not None:
            allowed = allowed & (doc_ids[b, q % S] == doc_ids[b, kv % S])
        return allowed

    return mask_mod


def train_inputs(input_ids: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """(B, S) clean tokens -> (B, 2S) clean tokens followed by S mask tokens (full-mask
    strategy)."""
    return torch.cat([input_ids, torch.full_like(input_ids, mask_token_id)], dim=1)


def train_position_ids(
    input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Positions of the doubled sequence: the masked half repeats the clean positions.

    With packed documents each document starts again at 0, as it would on its own.
    """
    B, S = input_ids.shape
    pos = torch.arange(S, device=input_ids.device).expand(B, S)
    if doc_ids is not None:
        starts = torch.ones_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        # Index of the most recent document start at or before each token.
        last_start = torch.where(starts, pos, torch.zeros_like(pos)).cummax(dim=1).values
        pos = pos - last_start
    return torch.cat([pos, pos], dim=1)


def train_labels(
    input_ids: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    no_ar_target: torch.Tensor | None = None,
):
    """(ar_labels, diff_labels), each (B, S).

    AR: clean token i predicts x_{i+1} (ignored at the chunk end and across a document boundary,
    and where `no_ar_target` (B, S, bool) marks x_{i+1}: text the AR half must not learn to write,
    say its own greedy continuations). Diffusion: masked slot S + i predicts x_i (not shifted).
    """
    ar = torch.full_like(input_ids, IGNORE_INDEX)
    ar[:, :-1] = input_ids[:, 1:]
    if doc_ids is not None:
        crosses = torch.zeros_like(input_ids, dtype=torch.bool)
        crosses[:, :-1] = doc_ids[:, 1:] != doc_ids[:, :-1]
        ar = ar.masked_fill(crosses, IGNORE_INDEX)
    if no_ar_target is not None:
        skip = torch.zeros_like(input_ids, dtype=torch.bool)
        skip[:, :-1] = no_ar_target[:, 1:]
        ar = ar.masked_fill(skip, IGNORE_INDEX)
    return ar, input_ids.clone()


def check_train_shape(seq_len: int, draft_length: int) -> None:
    """Training chunks are whole mask blocks: seq_len a multiple of draft_length."""
    check_draft_length(draft_length)
    if draft_length > seq_len:
        raise ValueError(
            f"draft_length={draft_length} is larger than seq_len={seq_len}; "
            "lower draft_length or raise seq_len."
        )
    if seq_len % draft_length:
        lower, higher = (
            seq_len - seq_len % draft_length,
            seq_len + draft_length - seq_len % draft_length,
        )
        raise ValueError(
            f"seq_len={seq_len} is not a multiple of draft_length={draft_length}; "
            f"use seq_len={lower} or {higher}."
        )


# --------------------------------------------------------------------------------------------
# Decoding: causal tokens, then groups of k mask tokens, after a KV cache. docs/method.md §3.
# --------------------------------------------------------------------------------------------


def group_anchors(first_group_sees, n_groups: int | None = None) -> list[int]:
    """Causal tokens each group sees, as host ints: an int means consecutive groups seeing
    first_group_sees, first_group_sees + 1, ... (today's full step); a sequence is used as given."""
    if isinstance(first_group_sees, int):
        return list(
            range(first_group_sees, first_group_sees + (1 if n_groups is None else n_groups))
        )
    return [int(a) for a in first_group_sees]


def tree_ancestors(parents) -> torch.Tensor:
    """(T, T) bool: [q, kv] is True where node kv is q itself or an ancestor of q. parents[0] = -1
    (draft 0, the committed token); every other node's parent comes before it."""
    # on the host: a tree's plan shapes rarely repeat, and row by row it was 3 kernels a node
    return torch.tensor(ancestor_rows(parents), dtype=torch.bool)


def ancestor_rows(parents) -> list[list[bool]]:
    """tree_ancestors as lists."""
    rows = []
    for i, parent in enumerate(int(p) for p in parents):
        row = rows[parent][:] if i else [False] * len(parents)
        row[i] = True
        rows.append(row)
    return rows


def decode_mask_mod(
    cache_len: int,
    n_causal: int,
    draft_length: int,
    first_group_sees,
    kv_valid: torch.Tensor | None = None,
    parents=None,
    device=None,
):
    """Queries: `n_causal` causal tokens, then groups of `draft_length` mask tokens.

    Every query sees the whole cache (minus padding). Group g sees the first `sees[g]` causal tokens
    and its own group bidirectionally, no other group; `first_group_sees` is an int (sees[g] =
    first_group_sees + g) or a sequence of anchors, one per group (a step plan that computes groups
    only at chosen acceptance lengths).
    Prefill: causal = prompt, one group that sees all of it (first_group_sees = prompt length).
    Step: causal = m drafts; a group anchored at j sees drafts[0..j) and sits at the positions after
    them.

    parents: None (the causal tokens are one chain), or a tree over them (a draft with alternatives,
    tree_ancestors): a causal token sees its ancestors and itself, and a group anchored at j sees
    causal token j - 1 and its ancestors. On a chain both readings are the same mask.

    kv_valid: (B, cache_len + n_queries) bool, False at left padding. A query always sees itself,
    so a padding row is never fully masked (SDPA would turn it into NaN and spread it through the
    cache).

    device: where the mask is evaluated (default: kv_valid's, else the CPU). The tables it reads are
    put there now: a compiled FlexAttention kernel cannot move a tensor the mask_mod captured.
    """
    C, T, k = cache_len, n_causal, draft_length
    device = device if device is not None else kv_valid.device if kv_valid is not None else "cpu"
    anchors = (
        None
        if isinstance(first_group_sees, int)
        else on_device(group_anchors(first_group_sees), torch.device(device), torch.long)
    )
    anc = None if parents is None else tree_ancestors(parents).to(device)

    def sees_token(node, kv_new):  # causal token kv_new is node itself or one of its ancestors
        if anc is None:
            return kv_new <= node
        return anc[node.clamp(0, T - 1), kv_new.clamp(0, T - 1)]

    def mask_mod(b, h, q, kv):
        q_causal = q < T
        kv_new = kv - C  # index of the key among this step's queries, negative inside the cache
        in_cache = kv_new < 0
        kv_causal = ~in_cache & (kv_new < T)
        q_group, kv_group = (q - T) // k, (kv_new - T) // k
        if anchors is None:
            sees = first_group_sees + q_group
        else:  # causal queries index group 0 here; their term below is masked out by ~q_causal
            sees = anchors[q_group.clamp(0, max(len(anchors) - 1, 0))] if len(anchors) else q_group
        causal = q_causal & kv_causal & sees_token(q, kv_new)
        drafts_seen = ~q_causal & kv_causal & sees_token(sees - 1, kv_new)
        same_group = ~q_causal & ~in_cache & ~kv_causal & (kv_group == q_group)
        allowed = in_cache | causal | drafts_seen | same_group
        if kv_valid is not None:
            allowed = allowed & kv_valid[b, kv]
        return allowed | (kv_new == q)

    return mask_mod


def decode_position_ids(
    start: torch.Tensor,
    n_causal: int,
    draft_length: int,
    n_groups: int,
    first_group_sees,
    parents=None,
) -> torch.Tensor:
    """Positions for one decode forward. start: (B,) position of the first causal token.

    Group g sits right after the causal tokens it sees: its slot 0 is the next token to predict.
    first_group_sees: an int (consecutive groups) or one anchor per group, as in decode_mask_mod.
    parents: a tree over the causal tokens (decode_mask_mod); each sits at its depth in the tree.
    """
    # on the host, then one copy: a tree's plan shapes rarely repeat (plan.position_offsets keeps
    # the rest), and with tensors this took a dozen small kernels
    if parents is None:
        causal = list(range(n_causal))
    else:
        causal = [sum(row) - 1 for row in ancestor_rows(parents)]
    anchors = group_anchors(first_group_sees, n_groups)
    groups = [causal[a - 1] + 1 for a in anchors] if parents is not None else anchors
    offsets = causal + [g + i for g in groups for i in range(draft_length)]
    return start[:, None] + on_device(offsets, start.device, torch.long)


def own_rows(n_causal: int, draft_length: int, anchors, parents=None) -> list[list[bool]]:
    """decode_mask_mod(0, n_causal, draft_length, anchors, parents=parents) over the step's own
    queries, (Q, Q), as lists built row by row on the host: a tree's plan shapes rarely repeat, and
    evaluating the mask_mod on a (Q, Q) grid takes two dozen small kernels. Anchors are at least 1
    (draft 0 is committed). tests/test_layout.py holds the two equal."""
    T, k, G = n_causal, draft_length, len(anchors)
    sees = (
        ancestor_rows(parents)
        if parents is not None
        else [[j <= i for j in range(T)] for i in range(T)]
    )
    rows = [row + [False] * (G * k) for row in sees]
    for g, anchor in enumerate(anchors):  # sees the causal token before its anchor, its own group
        group = sees[anchor - 1] + [False] * (g * k) + [True] * k + [False] * ((G - g - 1) * k)
        rows += [group] * k
    return rows


def decode_step_mask(
    cache_valid: torch.Tensor,
    n_causal: int,
    draft_length: int,
    anchors,
    attn_implementation: str | None,
    parents=None,
    local: "Local | None" = None,
    kept=None,
    slots: tuple[int, int] | None = None,
):
    """The attention_mask of one decode step after a cache, for this attention implementation.
    slots: (rows, columns) of a static cache's step (slots.in_slots), or None.

    cache_valid: (B, C) False at the cache's left padding. Dense masks are built from two reusable
    parts instead of evaluating decode_mask_mod over all (Q, C + Q) pairs every step: the cache
    columns are each row's cache_valid, and the (Q, Q) block among the step's own queries depends on
    the plan alone, so it is built once per plan (own_rows) and kept by `kept(key, make)` (the
    decoding session's, session.Session.own_mask; None: made every call)."""
    B, C = cache_valid.shape
    anchors = tuple(int(a) for a in anchors)
    Q = n_causal + len(anchors) * draft_length
    device = cache_valid.device
    if attn_implementation == "flex_attention":
        valid = torch.cat([cache_valid, torch.ones(B, Q, dtype=torch.bool, device=device)], 1)
        mask_mod = decode_mask_mod(C, n_causal, draft_length, anchors, valid, parents)
        if local is not None:
            return local.masks(
                attn_implementation, mask_mod=mask_mod, shape=(B, Q, C + Q), device=device
            )
        return to_block_mask(mask_mod, B, Q, C + Q, device=device)
    parents = None if parents is None else tuple(int(p) for p in parents)
    key = (n_causal, draft_length, anchors, parents, str(device))

    def own_mask():
        return on_device(own_rows(n_causal, draft_length, anchors, parents), device)[None, None]

    own = own_mask() if kept is None else kept(key, own_mask)
    dense = torch.cat(
        [cache_valid[:, None, None, :].expand(B, 1, Q, C), own.expand(B, 1, Q, Q)], -1
    )
    if slots is not None:
        dense = in_slots(dense, *slots)
    return (
        for_implementation(dense, attn_implementation)
        if local is None
        else local.masks(attn_implementation, dense=dense)
    )


# --------------------------------------------------------------------------------------------
# Evaluating a mask_mod.
# --------------------------------------------------------------------------------------------


def to_dense(mask_mod, batch: int, q_len: int, kv_len: int, device="cpu") -> torch.Tensor:
    """(B, 1, Q, KV) bool mask for SDPA (True = attend), from broadcast index grids."""
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device)[None, None, :, None]
    kv = torch.arange(kv_len, device=device)[None, None, None, :]
    return mask_mod(b, h, q, kv).expand(batch, 1, q_len, kv_len)


def to_block_mask(mask_mod, batch: int, q_len: int, kv_len: int, device="cuda"):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device)


def build_mask(
    mask_mod,
    batch: int,
    q_len: int,
    kv_len: int,
    attn_implementation: str | None,
    device,
    local: "Local | None" = None,
    slots: tuple[int, int] | None = None,
):
    """The attention_mask transformers should receive for this model's attention implementation:
    one mask, or {layer kind: mask} where `local` restricts some kinds (see Local). slots: (rows,
    columns) of a static cache's forward (slots.in_slots), or None."""
    if local is not None:
        dense = (
            None
            if attn_implementation == "flex_attention"
            else to_dense(mask_mod, batch, q_len, kv_len, device=device)
        )
        return local.masks(
            attn_implementation,
            dense=dense,
            mask_mod=mask_mod,
            shape=(batch, q_len, kv_len),
            device=device,
        )
    if attn_implementation == "flex_attention":
        return to_block_mask(mask_mod, batch, q_len, kv_len, device=device)
    dense = to_dense(mask_mod, batch, q_len, kv_len, device=device)
    return for_implementation(
        dense if slots is None else in_slots(dense, *slots), attn_implementation
    )


# --------------------------------------------------------------------------------------------
# Local attention: sliding windows and attention chunks, by layer kind.
# --------------------------------------------------------------------------------------------
# A 4D attention_mask replaces a model's own masks, windows and chunks included (transformers
# passes a 4D mask through as given). So the layout applies them, by position: a query, mask slots
# included, sees of its keys what a token at its position would see, as in transformers'
# sliding_window_overlay (q - k < window) and chunked_overlay (the same chunk of positions).


def local_kinds(config) -> dict | None:
    """{layer kind: allowed(q_pos, k_pos), or None for a kind that sees the whole prefix} for a
    model with sliding windows or attention chunks; the key "" when one kind covers every layer
    (Mistral's window: the model takes one mask). None when every layer sees the whole prefix."""
    window = (
        getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True)
        else None
    )
    chunk = getattr(config, "attention_chunk_size", None)
    local = {}
    if window:
        local["sliding_attention"] = lambda q, k: q - k < window
    if chunk:
        local["chunked_attention"] = lambda q, k: (
            torch.div(q, chunk, rounding_mode="floor") == torch.div(k, chunk, rounding_mode="floor")
        )
    kinds = list(dict.fromkeys(getattr(config, "layer_types", None) or []))
    if not kinds:  # no per-layer kinds: a window (or chunk) on every layer
        if len(local) > 1:
            raise ValueError(
                f"model_type={getattr(config, 'model_type', '?')!r} sets both sliding_window and "
                "attention_chunk_size without layer_types: which layers take which is not known, "
                "so TiDAR cannot mask them."
            )
        return {"": next(iter(local.values()))} if local else None
    if not set(kinds) & set(local):
        return None
    if len(kinds) == 1:
        return {"": local[kinds[0]]}
    return {kind: local.get(kind) for kind in kinds}


class Local:
    """The local kinds of a model (local_kinds) and the positions of one forward's keys (B, K), its
    queries being the keys from `q_offset` on (a forward's own tokens follow its cache): what turns
    the layout's mask into one mask per layer kind."""

    def __init__(self, kinds: dict, k_pos: torch.Tensor, q_offset: int = 0):
        self.kinds, self.k_pos, self.q_offset = kinds, k_pos, q_offset

    @classmethod
    def of(cls, config, k_pos: torch.Tensor, q_offset: int = 0) -> "Local | None":
        kinds = local_kinds(config)
        return None if kinds is None else cls(kinds, k_pos, q_offset)

    def masks(self, attn_implementation, dense=None, mask_mod=None, shape=None, device=None):
        """The layout's mask (dense bool (B, 1, Q, K), or its mask_mod for FlexAttention) restricted
        per kind: one mask for a one-kind model, else {kind: mask}."""
        k_pos, off = self.k_pos, self.q_offset
        out = {}
        for kind, allowed in self.kinds.items():
            if attn_implementation == "flex_attention":
                if allowed is None:
                    mod = mask_mod
                elif off == 0 and torch.device(device).type != "cpu":
                    # training, prefill: positions looked up lazily
                    def mod(b, h, q, kv, a=allowed):
                        return mask_mod(b, h, q, kv) & a(k_pos[b, q], k_pos[b, kv])

                else:
                    # evaluated once over (B, Q, K): torch 2.13's CPU FlexAttention template fails
                    # to compile position lookups in a mask_mod
                    near = allowed(k_pos[:, off : off + shape[1], None], k_pos[:, None, :])

                    def mod(b, h, q, kv, near=near):
                        return mask_mod(b, h, q, kv) & near[b, q, kv]

                out[kind] = to_block_mask(mod, *shape, device=device)
            else:
                Q = dense.shape[2]
                m = (
                    dense
                    if allowed is None
                    else dense
                    & allowed(k_pos[:, None, off : off + Q, None], k_pos[:, None, None, :])
                )
                out[kind] = for_implementation(m, attn_implementation)
        return out.pop("") if "" in out else out


def in_slots(dense: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """A step's dense (B, 1, Q, C + Q) bool mask as the static cache takes it, (B, 1, rows,
    columns): rows - Q padding slots after the step's own, each seeing only itself, and no query
    seeing an entry past them."""
    B, _, Q, width = dense.shape
    out = dense.new_zeros(B, 1, rows, columns)
    out[..., :Q, :width] = dense
    if rows > Q:
        pad = torch.arange(Q, rows, device=dense.device)
        out[..., pad, pad + width - Q] = True
    return out


def for_implementation(dense: torch.Tensor, attn_implementation: str | None) -> torch.Tensor:
    """A dense bool mask in the form the attention implementation reads. SDPA (and the CPU kernels)
    take bool; eager adds the mask to the scores, so it gets 0 where allowed and float32's minimum
    elsewhere (transformers' own additive masks; every query sees itself, so no row is all
    minimum)."""
    if attn_implementation != "eager":
        return dense
    return torch.zeros(dense.shape, dtype=torch.float32, device=dense.device).masked_fill(
        ~dense, torch.finfo(torch.float32).min
    )
