"""The family matrix: every entry of transformers' causal-LM mapping, as a tiny random model,
through a conversion (a few steps of the hybrid loss, then the real export) and exact greedy TiDAR
decoding; or refused by `families.check` with the mechanism named; or out of scope (not a
decoder-only text LM).

    PYTHONPATH=src:tests python tests/family_matrix.py --write docs/families.md   # the whole matrix
    PYTHONPATH=src:tests python tests/family_matrix.py llama gemma2              # some entries

tests/test_families.py runs entries from here and checks docs/families.md and the README against it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from helpers import cycle_batch, tiny_tokenizer, train_tiny

from tidar_convert.runtime.spec import TiDARSpec

DOC = Path(__file__).resolve().parent.parent / "docs" / "families.md"
MAX_PARAMETERS = 6_000_000
STEPS = 60  # enough for lookup and diffusion drafts to be accepted on a 7-token cycle
# Expert counts, ranks and head sizes a tiny model takes, where the config has the field at all.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    top_k_experts=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    sliding_window=6,
    attention_chunk_size=8,
    global_head_dim=16,
    num_global_key_value_heads=2,
    hidden_size_per_layer_input=16,
    laurel_rank=8,
    intermediate_size_mlp=128,
    ffn_hidden_size=128,
)
# The recurrent mixers' (Mamba, Mamba-2, SSM, gated delta / linear attention, xLSTM) state sizes a
# tiny model takes, where the config has the field: 8 heads of 16 (8 * 16 = expand 2 * hidden 64,
# as the Mamba-2 validators require), states of 16, scan chunks of 16. Their defaults (128 heads,
# states of 128-256, chunks of 256) make a tiny model's scan allocate gigabytes. Only for families
# with recurrent layers: chunk_size, state_size, num_heads and block_size mean other things
# elsewhere.
TINY_RECURRENT = dict(
    mamba_d_state=16,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_ssm=128,
    mamba_chunk_size=16,
    ssm_state_size=16,
    mamba_num_heads=8,
    mamba_head_dim=16,
    n_groups=2,
    chunk_size=16,
    state_size=16,
    num_heads=8,
    mamba_headdim=16,
    n_mamba_heads=8,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_heads=4,
    linear_head_dim=16,
    block_size=16,
)
# the layer kinds (transformers' `layer_types` convention) of a recurrent layer, and of layers
# that are neither recurrent nor attention
RECURRENT_KINDS = ("linear_attention", "conv", "recurrent", "mamba")
NOT_ATTENTION_KINDS = ("moe", "mlp")


def tiny_config(model_type: str, vocab_size: int):
    """A 2-layer config of this family with the tokenizer's vocabulary, keeping its mechanisms: the
    layer kinds of its defaults (one of each, sliding layer first), its experts, its latent KV."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default_config = cls()
    defaults = default_config.to_dict()
    aliases = getattr(cls, "attribute_map", {}) or {}  # GPT-J's n_embd for hidden_size, ...
    kw = {
        aliases.get(k, k): v
        for k, v in TINY.items()
        if aliases.get(k, k) in defaults and v is not None
    }
    # recurrent layers: the instance's layer_types (a property in Mamba, Jamba, Bamba, ...) name
    # them, or Mamba fields do (Falcon-H1's layers run attention and Mamba side by side)
    recurrent = bool(
        set(getattr(default_config, "layer_types", None) or []) & set(RECURRENT_KINDS)
        or any(k.startswith("mamba_") for k in defaults)
        or model_type == "xlstm"  # all mLSTM blocks, and no layer_types to say so
    )
    if recurrent:
        kw.update(
            {
                aliases.get(k, k): v
                for k, v in TINY_RECURRENT.items()
                if aliases.get(k, k) in defaults and aliases.get(k, k) not in kw
            }
        )
    # latent KV: the rotary part of a head is qk_rope_head_dim (LongCat's rotary reads head_dim)
    if "qk_rope_head_dim" in defaults:
        kw.pop("head_dim", None)
        if "head_dim" in defaults:
            kw["head_dim"] = kw["qk_rope_head_dim"]
    # MLA expands one latent to every head, as real ones do
    if "kv_lora_rank" in defaults and "num_key_value_heads" in kw:
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    # sizes in sub-configs; its attention reads a rope_theta its sub-config does not declare
    if model_type == "dbrx":
        kw["attn_config"] = {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}
        kw["ffn_config"] = {
            "hidden_size": 64,
            "ffn_hidden_size": 128,
            "moe_num_experts": 4,
            "moe_top_k": 2,
        }
    if "attention_types" in defaults:  # GPT-Neo: one global and one local layer
        kw["attention_types"] = [[["global", "local"], 1]]
    # Gemma 3n/4's per-layer embeddings: a second vocabulary
    if "vocab_size_per_layer_input" in defaults:
        kw["vocab_size_per_layer_input"] = vocab_size
    if "num_kv_shared_layers" in defaults:  # two layers share no cache
        kw["num_kv_shared_layers"] = 0
    if "n_inner" in defaults:
        kw["n_inner"] = 128
    if "rotary_dim" in defaults:
        kw["rotary_dim"] = 8
    if recurrent:
        hybrid_layout(default_config, defaults, kw)
    elif defaults.get("layer_types"):
        kinds = list(dict.fromkeys(defaults["layer_types"]))[:2]
        kw["layer_types"] = (
            (kinds * 2)[:2]
            if len(kinds) == 1
            else sorted(kinds, key=lambda k: k != "sliding_attention")
        )
    for key in ("mlp_layer_types", "mtp_layer_types", "mtp_mlp_layer_types"):
        if defaults.get(key):
            kinds = list(dict.fromkeys(defaults[key]))
            kw[key] = (kinds * 2)[:2]
    # Dory: an input, a looped and an output section, one layer each (its to_dict interleaves "mlp"
    # blocks)
    if "n_recurrent_loops" in defaults:
        kw.update(
            num_hidden_layers=3,
            n_input_layers=1,
            n_recurrent_layers=1,
            n_output_layers=1,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
    if "conv_L_cache" in defaults:  # LFM2: its short-convolution layers are its point
        kw["layer_types"] = ["conv", "full_attention"]
        if "full_attn_idxs" in defaults:
            kw["full_attn_idxs"] = [1]
    if model_type == "zaya":  # its validator: ZAYA's router supports top-1 routing only
        kw["num_experts_per_tok"] = 1
    # its QSA indexer has no defaults (None): 4 index heads of 16, 8 tokens chosen in blocks of 4
    if model_type == "qwen4_exp_text":
        kw.update(
            indexer_n_heads=4,
            indexer_kv_heads=1,
            indexer_head_dim=16,
            indexer_budget=8,
            indexer_compress_ratio=4,
        )
    # its cache rounds the q/k width (hidden * qk_dim_factor 0.5) up to a multiple of 64 and its
    # layers do not: they agree where hidden_size * 0.5 is one, as in real xLSTMs
    if model_type == "xlstm":
        kw["hidden_size"] = 128
    if "no_rope_layers" in defaults:
        kw["no_rope_layers"] = [1, 0]
    # rotary settings keyed by layer type, none by default (Cohere Compass): the plain ones
    if defaults.get("rope_parameters") == {}:
        kw["rope_parameters"] = {
            t: {"rope_type": "default", "rope_theta": 10000.0}
            for t in set(kw.get("layer_types") or defaults.get("layer_types") or ["full_attention"])
        }
    # inside the vocabulary: it is an embedding's padding_idx
    pad = None if defaults.get("pad_token_id") is None else 0
    kw.update(
        vocab_size=vocab_size,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=pad,
        tie_word_embeddings=bool(defaults.get("tie_word_embeddings")),
    )
    # one shared-attention block leaves its shared-block tie pattern nothing to tie, which
    # transformers rejects (ValueError) while word embeddings are tied
    if model_type == "zamba":
        kw["tie_word_embeddings"] = False
    return AutoConfig.for_model(model_type, **kw)


def hybrid_layout(default_config, defaults: dict, kw: dict) -> None:
    """Two layers of a family with recurrent layers, into kw: a recurrent one first, then an
    attention one where the family has attention layers (as its real models do; a cache without any
    attention layer breaks transformers' mask creation). Pure-recurrent families: two recurrent."""
    kinds = list(dict.fromkeys(getattr(default_config, "layer_types", None) or []))
    attention = [k for k in kinds if k not in RECURRENT_KINDS + NOT_ATTENTION_KINDS]
    # Bamba's and Granite 4.0's defaults are all Mamba; their checkpoints have attention layers too
    if not attention and "num_attention_heads" in defaults:
        attention = ["full_attention"]
    if not attention:
        return
    # the fields that place attention: a list of kinds (its own names), indices, or a period
    for key in ("layer_types", "layers_block_type", "block_types"):
        own = defaults.get(key)
        if isinstance(own, list) and own:
            own_kinds = list(dict.fromkeys(own))
            recurrent = [k for k in own_kinds if k in RECURRENT_KINDS]
            others = [k for k in own_kinds if k not in RECURRENT_KINDS + NOT_ATTENTION_KINDS]
            kw[key] = [recurrent[0] if recurrent else "linear_attention", (others or attention)[0]]
    if "attn_layer_indices" in defaults:
        kw["attn_layer_indices"] = [1]
    if "attn_layer_period" in defaults:
        kw.update(attn_layer_period=2, attn_layer_offset=1)


@dataclass
class Result:
    model_type: str
    outcome: str  # exact | refused | out of scope | fails
    mechanisms: list[str] = field(default_factory=list)
    detail: str = ""  # the refusal, or what failed
    tokens_per_nfe: float | None = None
    accepted: int = 0  # row-steps that accepted at least one proposal
    rejected: int = 0  # row-steps that rejected a verified proposal
    sampled: str = (
        ""  # the sampling check, where run: "exact" (accepted/rejected row-steps), or what failed
    )
    seconds: float = 0.0

    @property
    def exact_tested(self) -> bool:
        return self.outcome == "exact" and self.accepted > 0 and self.rejected > 0


@contextlib.contextmanager
def counting_verify(counts, verifier=None):
    """Count, at every verification, the rows that accepted and the rows that rejected a proposal
    (an entry never rejecting, or never accepting, has not tested exactness). counts: anything with
    `accepted` and `rejected`; verifier: the class whose verify is counted (Greedy by default)."""
    from tidar_convert.runtime.verify import Greedy, real_slots

    cls = verifier or Greedy
    # the engine's entry (verify_tokens: the verdict, and AR's token at every draft row);
    # a class that inherits it gets its own for the block, then loses it again
    own = cls.__dict__.get("verify_tokens")
    original = cls.verify_tokens

    def verify_tokens(self, scores, draft):
        accepted, tokens = original(self, scores, draft)
        # proposals this step verified
        verified = (real_slots(draft)[:, : scores.shape[1] - 1]).sum(1)
        counts.accepted += int((accepted > 1).sum())
        counts.rejected += int((accepted - 1 < verified).sum())
        return accepted, tokens

    cls.verify_tokens = verify_tokens
    try:
        yield
    finally:
        if own is None:
            del cls.verify_tokens
        else:
            cls.verify_tokens = own


@contextlib.contextmanager
def nothing_refused():
    """families.REFUSED emptied: what a refused mechanism does when converted anyway (--force)."""
    from tidar_convert.models import families

    saved = dict(families.REFUSED)
    families.REFUSED.clear()
    try:
        yield
    finally:
        families.REFUSED.update(saved)


def run(model_type: str, tokenizer=None, steps: int = STEPS, sampling: bool = False) -> Result:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from tidar_convert.models.families import check

    started = time.perf_counter()
    try:
        CONFIG_MAPPING[model_type]()
    # a config that cannot be built from defaults is not a model one can bring
    except Exception as e:
        return Result(
            model_type,
            "out of scope",
            detail=(
                f"its config has no usable defaults ({type(e).__name__}); a checkpoint-only entry"
            ),
        )
    tokenizer = tokenizer or tiny_tokenizer()
    try:
        config = tiny_config(model_type, len(tokenizer))
    except Exception as e:
        config = CONFIG_MAPPING[model_type]()
        verdict = check(config)
        if not verdict.converts:
            return Result(
                model_type,
                "out of scope" if not verdict.decoder_only else "refused",
                verdict.mechanisms,
                verdict.reason,
            )
        return Result(
            model_type,
            "fails",
            verdict.mechanisms,
            f"tiny config: {type(e).__name__}: {' '.join(str(e).split())[:200]}",
        )
    verdict = check(config)
    result = Result(model_type, "exact", verdict.mechanisms)
    if not verdict.converts:
        result.outcome, result.detail = (
            ("refused" if verdict.decoder_only else "out of scope"),
            verdict.reason,
        )
        return result
    from tidar_convert.models.families import parameter_count

    threads = torch.get_num_threads()
    # tiny matrices: a second thread costs more in sync than it computes
    torch.set_num_threads(1)
    try:
        n = parameter_count(config)
        # a size field this generator does not know: seconds would become minutes
        if n > MAX_PARAMETERS:
            raise ValueError(
                f"tiny config has {n / 1e6:.1f} M parameters: "
                "teach tiny_config this family's size fields"
            )
        convert_and_decode(config, tokenizer, steps, result, sampling)
    except Exception as e:
        result.outcome = "fails"
        result.detail = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        if "-v" in sys.argv:
            traceback.print_exc()
    finally:
        torch.set_num_threads(threads)
    result.seconds = time.perf_counter() - started
    return result


def convert_and_decode(
    config, tokenizer, steps: int, result: Result, sampling: bool = False
) -> None:
    """Save a tiny random base, load it as `fit` does (load_base), train, export, load the export,
    and decode greedily with TiDAR against AR: k = 2 and 4, one row and a left-padded batch of two;
    with `sampling`, sampled too (sample_check)."""
    from transformers import AutoModelForCausalLM

    from tidar_convert import export, load
    from tidar_convert.models.families import attention_implementation
    from tidar_convert.models.loading import load_base

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(
            config, attn_implementation=attention_implementation(config)
        )
        base.save_pretrained(Path(tmp) / "base")
        tokenizer.save_pretrained(Path(tmp) / "base")
        model, tok = load_base(str(Path(tmp) / "base"))
        train_tiny(model, steps=steps, seq_len=16)
        model = load(export(model, tok, Path(tmp) / "export", TiDARSpec(4)))
        model.eval()
        nfe = new = 0
        outputs = []
        with counting_verify(result), torch.no_grad():
            for k in (2, 4):
                for ids, mask in prompts(tok.pad_token_id):
                    kw = dict(
                        max_new_tokens=24, do_sample=False, eos_token_id=None, attention_mask=mask
                    )
                    expected = model.generate(ids, tidar=False, **kw)
                    # T/NFE that does not depend on step timings
                    got = model.generate(ids, draft_length=k, plan="adaptive", **kw)
                    if not torch.equal(got, expected):
                        row = int((got != expected).any(1).nonzero()[0])
                        at = int((got[row] != expected[row]).nonzero()[0])
                        raise AssertionError(
                            f"TiDAR greedy != AR at k={k}, batch {ids.shape[0]}, "
                            f"row {row}, token {at - ids.shape[1]}"
                        )
                    nfe += model.tidar_stats["nfe"]
                    new += model.tidar_stats["new_tokens"] * ids.shape[0]
                    outputs.append((ids, dict(draft_length=k, plan="adaptive", **kw), got))
        result.tokens_per_nfe = new / nfe
        remote_code_decodes_the_same(Path(tmp) / "export", outputs)
        if sampling:
            result.sampled = sample_check(model, tok.pad_token_id)
        if not result.exact_tested:
            result.outcome = "untested"
            result.detail = (
                f"exact, but drafts were accepted in {result.accepted} "
                f"and rejected in {result.rejected} row-steps: train longer"
            )


def remote_code_decodes_the_same(export_dir: Path, outputs) -> None:
    """The export as users load it (`from_pretrained(..., trust_remote_code=True)`: its own
    custom_generate/, with tidar_convert blocked from import) writes what the package's
    decode wrote."""
    from transformers import AutoModelForCausalLM

    saved = sys.modules.get("tidar_convert")
    sys.modules["tidar_convert"] = None  # any import of the package now fails
    try:
        remote = AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True).eval()
        with torch.no_grad():
            for ids, kw, expected in outputs:
                if not torch.equal(remote.generate(ids, **kw), expected):
                    raise AssertionError(
                        "the export's remote code decodes otherwise than the "
                        f"package at {kw['draft_length']=}, batch {ids.shape[0]}"
                    )
        if not getattr(remote, "tidar_stats", None):
            raise AssertionError(
                "the export's remote code did not run TiDAR (no tidar_stats): "
                "transformers fell back to its own generate"
            )
    finally:
        sys.modules["tidar_convert"] = saved


# hot enough that AR's draws leave the cycle
SAMPLING = dict(do_sample=True, temperature=1.3, top_k=0, top_p=1.0)


@dataclass
class Counts:
    accepted: int = 0
    rejected: int = 0


def sample_check(model, pad: int, seed: int = 11) -> str:
    """Sampled TiDAR (k = 2 and 4, each drafter, the prompts above) against an independent AR loop:
    the full prefix through the export's forward every token (no cache, no TiDAR code but the
    noise), token = argmax p(v) / E(v) with the exponential draws `Sampling` keys by (seed, row,
    index). The verifier makes the output that AR sample whatever the drafts (docs/method.md), so
    every variant must equal the loop token for token, with drafts both accepted and rejected."""
    from tidar_convert.runtime.verify import Sampling, draw_seed

    new_tokens, counts = 16, Counts()
    with counting_verify(counts, Sampling), torch.no_grad():
        for ids, mask in prompts(pad):
            torch.manual_seed(seed)
            expected = sampled_ar(model, ids, mask, draw_seed(), new_tokens)
            for k, drafter in ((2, "hybrid"), (4, "hybrid"), (4, "diffusion")):
                torch.manual_seed(seed)  # generate() draws its base seed as draw_seed() did above
                got = model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=new_tokens,
                    eos_token_id=None,
                    draft_length=k,
                    drafter=drafter,
                    plan="adaptive",
                    **SAMPLING,
                )
                if not torch.equal(got[:, ids.shape[1] :], expected):
                    raise AssertionError(
                        f"sampled TiDAR != sampled AR at k={k}, "
                        f"drafter={drafter}, batch {ids.shape[0]}"
                    )
    if not (counts.accepted and counts.rejected):
        raise AssertionError(
            f"sampling: drafts accepted in {counts.accepted} and "
            f"rejected in {counts.rejected} row-steps: not tested"
        )
    return f"exact ({counts.accepted} accepted, {counts.rejected} rejected)"


def sampled_ar(model, ids, mask, seed: int, new_tokens: int) -> torch.Tensor:
    """AR sampling with `Sampling`'s noise, row by row without its padding: (B, new_tokens)."""
    from tidar_convert.runtime.verify import Sampling

    noise, rows = Sampling(seed), []
    for b in range(ids.shape[0]):
        seq = ids[b][mask[b].bool()] if mask is not None else ids[b]
        for t in range(new_tokens):
            logits = model(seq[None]).logits[0, -1].float() / SAMPLING["temperature"]
            p = logits.softmax(-1)
            seq = torch.cat([seq, (p / noise.draws(b, t, p.shape[-1], p.device)).argmax()[None]])
        rows.append(seq[-new_tokens:])
    return torch.stack(rows)


def prompts(pad: int):
    """One row on the training cycle; a left-padded batch of two: the cycle, and a broken cycle
    whose continuation the drafts get wrong at first (so drafts are rejected as well as
    accepted)."""
    one = cycle_batch(1, 9, seed=2)
    cyc = cycle_batch(1, 11, seed=5)[0]
    broken = torch.tensor([3, 9, 4, 8, 5, 5, 6, 7, 3, 4, 9])
    short = cycle_batch(1, 7, seed=1)[0]
    batch = torch.stack([broken, torch.cat([torch.full((4,), pad), short])])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    return [(one, None), (cyc[None], None), (batch, mask)]


# ----------------------------------------------------------------------------------------------
# The generated table.
# ----------------------------------------------------------------------------------------------

HEADER = """# Supported models: the family matrix

Generated by `PYTHONPATH=src:tests python tests/family_matrix.py --write docs/families.md` from
transformers {version}: every entry of its causal-LM mapping (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`),
as a tiny random 2-layer model, trained {steps} steps of the hybrid loss, exported, then decoded
greedily with TiDAR from the export against plain AR at k = 2 and 4, on one row and a left-padded
batch of two, and again through the export's own code (`trust_remote_code=True`, tidar_convert
blocked from import). Sliding windows (6 tokens) and attention chunks (8) are shorter than the
training and decoded lengths, so they bind in both. The CI subset (`SAMPLED` in
tests/test_families.py) is also sampled (temperature 1.3), against an independent AR loop with the
same noise. **exact**: token for token equal, with drafts both accepted and rejected;
**refused**: `tidar-convert check` / `fit` refuse it before any work, naming the mechanism;
**out of scope**: not a decoder-only text LM. Do not edit by hand; tests/test_families.py checks it.

Counts: {counts}.

| model_type | outcome | mechanisms | T/NFE | rejected | detail |
|---|---|---|---|---|---|
"""


def table(results: list[Result]) -> str:
    from collections import Counter

    import transformers

    counts = Counter(r.outcome for r in results)
    text = HEADER.format(
        version=transformers.__version__,
        steps=STEPS,
        counts=", ".join(f"{n} {o}" for o, n in sorted(counts.items())),
    )
    for r in sorted(results, key=lambda r: (ORDER.index(r.outcome), r.model_type)):
        tpn = f"{r.tokens_per_nfe:.2f}" if r.tokens_per_nfe else ""
        rej = str(r.rejected) if r.outcome in ("exact", "untested") else ""
        detail = r.detail.replace("|", "/")
        text += (
            f"| {r.model_type} | {r.outcome} | "
            f"{', '.join(r.mechanisms)} | {tpn} | {rej} | {detail} |\n"
        )
    return text


ORDER = ["exact", "untested", "fails", "refused", "out of scope"]


def read_table(path: Path = DOC) -> dict[str, str]:
    """{model_type: outcome} from a generated table."""
    out = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[1] in ORDER:
            out[cells[0]] = cells[1]
    return out


def documented_version(path: Path = DOC) -> str:
    """The transformers release a generated table was made from (its header says)."""
    import re

    found = re.search(r"from\s+transformers ([0-9][^\s:]*):", path.read_text())
    if not found:
        raise ValueError(
            f"{path} does not say which transformers it was generated "
            "from: regenerate it (tests/family_matrix.py --write)"
        )
    return found.group(1)


def entries() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_types", nargs="*")
    parser.add_argument("--write", type=Path)
    parser.add_argument("-v", action="store_true")
    parser.add_argument(
        "--sampling", action="store_true", help="add the sampling check (the CI entries run it)"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="convert refused decoder-only entries anyway, to measure why they are refused",
    )
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    tokenizer = tiny_tokenizer()
    results = []
    for model_type in args.model_types or entries():
        with nothing_refused() if args.force else contextlib.nullcontext():
            r = run(model_type, tokenizer, sampling=args.sampling)
        results.append(r)
        tpn = f"{r.tokens_per_nfe:.2f}" if r.tokens_per_nfe else "-"
        print(
            f"{model_type:26s} {r.outcome:12s} T/NFE {tpn:5s} acc {r.accepted:3d} "
            f"rej {r.rejected:3d} {r.seconds:5.1f}s {r.sampled} {r.detail[:150]}",
            flush=True,
        )
    if args.write:
        args.write.write_text(table(results))


if __name__ == "__main__":
    main()
