"""The export: self-contained TiDAR generate() via remote code, the base class without it."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import OLD_TRANSFORMERS, cycle_batch, old_transformers, tiny_config
from transformers import AutoModelForCausalLM

from tidar_convert import export, load
from tidar_convert.exports.folder import check_export
from tidar_convert.exports.marker import MARKER, is_export
from tidar_convert.runtime.spec import TiDARSpec


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    model, tok = trained["qwen3"]
    return export(model, tok, tmp_path_factory.mktemp("export") / "tidar", TiDARSpec(4))


def test_folder_contents(exported):
    names = {p.name for p in exported.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "custom_generate",
        "README.md",
        MARKER,
    } <= names
    assert check_export(exported) == TiDARSpec(
        draft_length=4,
        mask_token_id=json.loads((exported / "config.json").read_text())["mask_token_id"],
        alpha=1.0,
    )
    assert not list(exported.parent.glob(".*tmp-*")), "temporary folder left behind"
    listed = json.loads((exported / MARKER).read_text())["files"]
    assert "README.md" in listed and "custom_generate/generate.py" in listed and is_export(exported)


def test_model_card_loads_as_a_hub_card(exported):
    hub = pytest.importorskip("huggingface_hub")
    card = hub.ModelCard.load(exported / "README.md")
    assert card.data.library_name == "transformers" and {"tidar", "custom_generate"} <= set(
        card.data.tags
    )
    assert (
        "trust_remote_code=True" in card.text
        and "draft length (tokens drafted per step): 4" in card.text
    )


@pytest.mark.subprocess
def test_runs_without_tidar_convert_installed(exported):
    """The acceptance test: tidar_convert blocked from import, TiDAR greedy == AR greedy, drafts
    accepted."""
    script = textwrap.dedent(
        f"""
        import sys, json, torch
        sys.modules["tidar_convert"] = None  # any import of the package now fails
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(exported)!r}, trust_remote_code=True)
        ids = torch.tensor({cycle_batch(1, 5, seed=2).tolist()})
        td = m.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
        stats = dict(m.tidar_stats)
        ar = m.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None, tidar=False)
        linears = sum(isinstance(x, torch.nn.Linear) for x in m.modules())
        print(json.dumps({{"same": torch.equal(td, ar), "tpn": stats["tokens_per_nfe"],
                           "mod": type(m).__module__, "products": m.tidar_products,
                           "linears": linears}}))
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["same"] and out["tpn"] > 1.5
    assert out["mod"].startswith("transformers.models.qwen3")
    assert (
        set(out["products"]) <= {"panels", "onednn", "stock"}
        and sum(out["products"].values()) == out["linears"]
    )  # which product each layer took


@pytest.mark.slow
@pytest.mark.subprocess
def test_an_export_decodes_under_an_older_transformers(exported):
    """The export's own code, tidar_convert blocked, under transformers 5.17: it loads and TiDAR
    greedy equals AR greedy (a name the runtime imports from a newer release fails here)."""
    import os

    script = textwrap.dedent(
        f"""
        import sys, json, torch
        sys.modules["tidar_convert"] = None
        import transformers
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(exported)!r}, trust_remote_code=True)
        ids = torch.tensor({cycle_batch(1, 5, seed=2).tolist()})
        td = m.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
        tpn = m.tidar_stats["tokens_per_nfe"]
        ar = m.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None, tidar=False)
        print(json.dumps({{"version": transformers.__version__, "same": torch.equal(td, ar),
                           "tpn": tpn}}))
        """
    )
    env = {**os.environ, "PYTHONPATH": old_transformers()}
    res = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["version"] == OLD_TRANSFORMERS[0].split("==")[1]
    assert out["same"] and out["tpn"] > 1.5


def test_the_exports_code_builds_the_packages_panel_kernel(exported):
    """custom_generate/ carries the kernel's C source (csrc/panel.c) as panel_source.py, since
    transformers' module cache copies only .py files: loaded as transformers loads it, the export's
    panel.py reads that copy and builds the same library file as the package's."""
    from pathlib import Path

    from transformers.dynamic_module_utils import (
        HF_MODULES_CACHE,
        get_cached_module_file,
        get_class_in_module,
    )

    from tidar_convert.runtime import panel

    module = Path(get_cached_module_file(str(exported), "custom_generate/generate.py"))
    cached = Path(HF_MODULES_CACHE) / module.parent
    assert {"panel.py", "panel_source.py"} <= {p.name for p in cached.iterdir()} and not (
        cached / "csrc"
    ).exists()
    shipped = module.parent / "panel.py"
    assert get_class_in_module("panel_source", shipped)() == panel.SOURCE_FILE.read_text()
    if panel.panel_library() is None:
        pytest.skip("no C compiler with OpenMP: no panel kernel to compare")
    assert get_class_in_module("panel_library", shipped)()._name == panel.panel_library()._name


def test_without_remote_code_it_is_the_plain_base_model(exported, trained):
    model, _ = trained["qwen3"]
    plain = AutoModelForCausalLM.from_pretrained(exported)
    assert type(plain) is type(model)
    ids = cycle_batch(1, 6, seed=3)
    # Likelihood is the AR model's: one causal pass, identical logits to the weights exported.
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits)
    out = plain.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert not hasattr(plain, "tidar_stats") and out.shape[1] == 14


def test_library_load_needs_no_remote_code(exported):
    m = load(exported)
    ids = cycle_batch(1, 5, seed=4)
    td = m.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert m.tidar_stats["tokens_per_nfe"] > 1.5
    assert sum(m.tidar_products.values()) == sum(
        isinstance(x, torch.nn.Linear) for x in m.modules()
    )  # which product each layer took
    assert torch.equal(
        td, m.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None, tidar=False)
    )


def test_not_an_export_is_refused(tiny_dirs, tmp_path):
    with pytest.raises(ValueError, match="not a TiDAR export"):
        load(tiny_dirs["llama"])
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_export(tmp_path)


def test_lora_is_merged_on_export(tiny_dirs, tmp_path):
    from peft import LoraConfig, get_peft_model

    from tidar_convert.models.loading import load_base

    model, tok = load_base(str(tiny_dirs["llama"]))
    peft_model = get_peft_model(
        model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    )
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
    out = export(peft_model, tok, tmp_path / "lora", TiDARSpec(4))
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n in reloaded.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied and tied embeddings
def test_lora_with_trained_mask_row_is_merged_on_export(tiny_dirs, tmp_path, family):
    """LoRA training also trains the mask token's embedding row (peft trainable tokens): the export
    must keep it."""
    from peft import LoraConfig, get_peft_model

    from tidar_convert.models.loading import load_base

    model, tok = load_base(str(tiny_dirs[family]))
    mask_id = tok.mask_token_id
    before = model.get_input_embeddings().weight.detach().clone()
    cfg = LoraConfig(
        r=4, target_modules="all-linear", trainable_token_indices={"embed_tokens": [mask_id]}
    )
    peft_model = get_peft_model(model, cfg)
    trainable = [
        p for n, p in peft_model.named_parameters() if p.requires_grad and "trainable_tokens" in n
    ]
    assert trainable, "the mask row is not trainable"
    with torch.no_grad():
        for p in trainable:
            p.add_(1.0)
        ids = torch.tensor([[5, mask_id, 7]])
        expected = peft_model(input_ids=ids).logits
    out = export(peft_model, tok, tmp_path / "lora", TiDARSpec(4))
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    after = reloaded.get_input_embeddings().weight.detach()
    assert not torch.allclose(after[mask_id], before[mask_id])
    torch.testing.assert_close(after[:mask_id], before[:mask_id])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def untrained_export(tiny_dirs, tmp_path_factory):
    from tidar_convert.models.loading import load_base

    m, tok = load_base(str(tiny_dirs["llama"]))
    return export(m, tok, tmp_path_factory.mktemp("cb") / "tidar", TiDARSpec(4))


def test_continuous_batching_warns_that_tidar_does_not_run(untrained_export):
    """transformers' continuous batching (serve --continuous-batching, generate_batch) never calls
    model.generate: a TiDAR model says so, naming the fix, the first time it enters that loop; a
    model without TiDAR's generate says nothing."""
    import logging

    from tidar_convert.runtime.generate import CONTINUOUS_BATCHING_WARNING

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    tidar_log = logging.getLogger("transformers.cli.tidar")  # decode.py's logger: what serve prints
    tidar_log.addHandler(handler)
    level = tidar_log.level
    # an in-process `fit` earlier in the run sets transformers' verbosity to error
    tidar_log.setLevel(logging.WARNING)
    try:
        # another test may have warned already (once per process)
        logging.Logger.warning_once.cache_clear()
        # transformers' generate: no word
        AutoModelForCausalLM.from_pretrained(untrained_export).init_continuous_batching()
        assert said == []
        # the export's own generate.py
        remote = AutoModelForCausalLM.from_pretrained(untrained_export, trust_remote_code=True)
        manager = remote.init_continuous_batching()
        assert said == [CONTINUOUS_BATCHING_WARNING] and "without --continuous-batching" in said[0]
        # the loop still runs, as AR: the server keeps answering
        assert type(manager).__name__ == "ContinuousBatchingManager"
        logging.Logger.warning_once.cache_clear()
        # tidar_convert.load binds the package's generate
        load(untrained_export).init_continuous_batching()
        assert said == [CONTINUOUS_BATCHING_WARNING] * 2
    finally:
        tidar_log.removeHandler(handler)
        tidar_log.setLevel(level)


def test_tidar_off_through_a_generation_config(untrained_export):
    """A server passes a request's generation config, not keyword arguments (`transformers serve`:
    the request's `generation_config` JSON): its `tidar` field turns TiDAR off; the keyword wins
    over it, and the model's generation_config.json is read last."""
    from transformers import GenerationConfig

    model = load(untrained_export)
    ids = torch.tensor([[5, 6, 7, 8]])
    ar = model.generate(ids, max_new_tokens=6, do_sample=False, tidar=False)

    def ran_tidar(**kw) -> bool:
        out = model.generate(ids, max_new_tokens=6, do_sample=False, **kw)
        assert torch.equal(out, ar)  # greedy: the same tokens either way
        return "draft_sources" in model.tidar_stats  # only TiDAR's stats name draft sources

    # as the server builds it
    off = GenerationConfig(**json.loads('{"tidar": false, "do_sample": false}'))
    assert ran_tidar() and not ran_tidar(generation_config=off)
    assert ran_tidar(generation_config=off, tidar=True)
    model.generation_config.tidar = False  # as a generation_config.json with "tidar": false loads
    try:
        assert not ran_tidar() and ran_tidar(
            generation_config=GenerationConfig(tidar=True, do_sample=False)
        )
    finally:
        del model.generation_config.tidar
    with pytest.raises(ValueError, match="tidar='false'.*JSON boolean"):
        model.generate(ids, max_new_tokens=2, generation_config=GenerationConfig(tidar="false"))


# --------------------------------------------------------------------------------------------
# Issue 48: a LoRA export is also a PEFT adapter folder, `merge` makes it an export again, and
# `export --dtype` defaults to the base's dtype.
# --------------------------------------------------------------------------------------------


def tidar_greedy(model, ids, **kwargs):
    return model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied and tied embeddings
def test_a_lora_export_is_a_peft_adapter_that_decodes_with_tidar_and_merges_back(
    tiny_dirs, tmp_path, family, capsys
):
    """Stock PEFT loads OUT/adapter on the base as README.md says; decoding it with the export's
    own generate (custom_generate) gives the merged export's greedy TiDAR output, and `merge`
    writes an export that gives it too."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoTokenizer

    from tidar_convert.cli import main, merge_cmd
    from tidar_convert.models.loading import load_base
    from tidar_convert.models.lora import add_lora

    base_dir = tiny_dirs[family]
    model, tok = load_base(str(base_dir))
    TiDARSpec(4, tok.mask_token_id).write(model.config)
    model = add_lora(model, 4, 8, tok.mask_token_id, "all")
    torch.manual_seed(1)
    with torch.no_grad():  # trained adapters and mask row, as a run leaves them
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    out = export(model, tok, tmp_path / "out", card={"base_model": str(base_dir)})
    adapter = out / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_dir.resolve())
    assert {"adapter_model.safetensors", "tidar.json"} <= {p.name for p in adapter.iterdir()}
    assert is_export(out)  # the marker lists the adapter's files too

    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    base.resize_token_embeddings(len(AutoTokenizer.from_pretrained(adapter)))
    peft_model = PeftModel.from_pretrained(base, adapter).eval()
    peft_model.config.update(json.loads((adapter / "tidar.json").read_text()))
    ids = cycle_batch(2, 6, seed=1)
    got = tidar_greedy(peft_model, ids, custom_generate=str(out), trust_remote_code=True)
    assert "nfe" in peft_model.get_base_model().tidar_stats  # TiDAR decoded it, not plain AR
    merged = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert torch.equal(got, tidar_greedy(merged, ids))
    assert AutoConfig.from_pretrained(out).tidar == peft_model.config.tidar

    again = merge_cmd(str(adapter), str(tmp_path / "merged"))
    assert torch.equal(tidar_greedy(load(again), ids), tidar_greedy(load(out), ids))
    assert (tmp_path / "merged" / "adapter" / "adapter_model.safetensors").is_file()

    other = tmp_path / "other"  # the same tokenizer, wider layers: the adapters' shapes differ
    wider = tiny_config(family, len(AutoTokenizer.from_pretrained(base_dir)))
    wider.hidden_size, wider.intermediate_size = 96, 192
    AutoModelForCausalLM.from_config(wider).save_pretrained(other)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(other)
    refusals = [
        (["--adapter", str(out)], "lacks adapter_config.json, adapter_model.safetensors"),
        (["--adapter", str(tmp_path / "none")], "is not a folder"),
        (["--out", str(tmp_path / "merged")], "holds an earlier export; pass --overwrite"),
        (["--model", str(other)], "does not fit the base"),
        (["--dtype", "fp8"], "--dtype 'fp8': choose float32, bfloat16, float16"),
    ]
    for change, message in refusals:
        args = {"--adapter": str(adapter), "--out": str(tmp_path / "new"), **dict([change])}
        capsys.readouterr()
        with pytest.raises(SystemExit):
            main(["merge", *[x for pair in args.items() for x in pair]])
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and errors[0].startswith("error: "), (change, errors)
        assert message in errors[0], (change, errors)
        assert not (tmp_path / "new").exists()


@pytest.mark.fit
def test_export_dtype_defaults_to_the_bases(tiny_dirs, tmp_path, capsys):
    """A bf16 base exports bf16 (half the bytes of fp32), --dtype float32 overrides, and a dtype
    not offered is refused before the checkpoint is read."""
    from pathlib import Path

    from safetensors import safe_open

    from tidar_convert.cli import main

    base = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.bfloat16).save_pretrained(
        base
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (base / name).write_bytes((tiny_dirs["llama"] / name).read_bytes())
    recipe = str(Path(__file__).parents[1] / "recipes" / "tiny.yaml")
    main(["fit", "--config", recipe, "--model.model", str(base), "--model.lora_r", "4",
          "--trainer.max_steps", "2", "--trainer.logger", "false",
          "--trainer.default_root_dir", str(tmp_path / "run")])  # fmt: skip
    ckpt = str(tmp_path / "run" / "checkpoints" / "last.ckpt")

    def dtypes(folder):
        with safe_open(folder / "model.safetensors", "pt") as f:
            return {f.get_slice(k).get_dtype() for k in f.keys()}

    main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "bf16-out")])
    main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "fp32"), "--dtype", "float32"])
    assert dtypes(tmp_path / "bf16-out") == {"BF16"} and dtypes(tmp_path / "fp32") == {"F32"}
    assert json.loads((tmp_path / "bf16-out" / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(SystemExit):
        main(["export", "--checkpoint", "nowhere.ckpt", "--out", str(tmp_path / "x"),
              "--dtype", "int8"])  # fmt: skip
    assert "error: --dtype 'int8': choose float32, bfloat16, float16" in capsys.readouterr().err
