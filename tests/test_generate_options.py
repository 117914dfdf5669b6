"""TiDAR's own generate() options (drafter, plan, slot budget, siblings, draft length...) come from
an argument, else the generation_config passed, else the model's generation_config.json, so user
code, `transformers serve` and lm-eval can set them; and `tidar-convert generate` runs on any
device and streams its text."""

import pytest
import torch
from helpers import cycle_batch
from transformers import GenerationConfig

from tidar_convert.runtime.generate import OPTIONS, generate, tidar_options


def test_an_argument_wins_then_the_config_passed_then_the_models_then_the_default():
    passed, models = GenerationConfig(plan="adaptive"), GenerationConfig(plan="full", siblings=0)
    got = tidar_options({"plan": None, "drafter": "lookup"}, passed, models)
    assert got["plan"] == "adaptive" and got["drafter"] == "lookup" and got["siblings"] == 0
    assert got["slot_budget"] is None and got["pack_weights"] == OPTIONS["pack_weights"]
    assert tidar_options({}, None, GenerationConfig())["drafter"] == "hybrid"


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("tidar", "false", "tidar='false'"),
        ("siblings", "3", "siblings='3'"),
        ("slot_budget", 9.5, "slot_budget=9.5"),
        ("beta", "1", "beta='1'"),
    ],
)
def test_a_config_value_of_the_wrong_kind_is_refused_by_name(field, value, named):
    with pytest.raises(ValueError, match=named):
        tidar_options({}, GenerationConfig(**{field: value}))


def sources(model):
    return {s for s, n in model.tidar_stats["draft_sources"].items() if n and s != "none"}


def test_generate_reads_the_drafter_and_plan_from_the_generation_configs(trained):
    model, _ = trained["llama"]
    ids = cycle_batch(1, 8, seed=4)
    kw = dict(model=model, max_new_tokens=24, eos_token_id=None)
    by_argument = generate(ids, drafter="lookup", plan="adaptive", **kw)
    assert sources(model) == {"lookup"}
    by_config = generate(ids, GenerationConfig(drafter="lookup", plan="adaptive"), **kw)
    assert sources(model) == {"lookup"} and torch.equal(by_config, by_argument)
    saved = model.generation_config
    try:
        model.generation_config = GenerationConfig(**saved.to_dict())
        model.generation_config.drafter = "diffusion"  # as an export's generation_config.json
        generate(ids, **kw)
        assert sources(model) == {"diffusion"}
        generate(ids, drafter="lookup", **kw)  # an argument overrides the file
        assert sources(model) == {"lookup"}
        generate(ids, GenerationConfig(drafter="lookup"), **kw)  # and so does a request's config
        assert sources(model) == {"lookup"}
    finally:
        model.generation_config = saved


@pytest.fixture(scope="module")
def export_dir(trained, tmp_path_factory):
    from tidar_convert.exports.folder import export
    from tidar_convert.runtime.spec import TiDARSpec

    model, tok = trained["llama"]
    return export(model, tok, tmp_path_factory.mktemp("options") / "tidar", TiDARSpec(4))


def test_the_cli_streams_the_same_text_it_prints_at_the_end(export_dir, capsys):
    from tidar_convert.cli import main

    args = ["generate", "--model", str(export_dir), "--prompt", "3 4 5", "--max-new-tokens", "12"]
    main([*args, "--device", "cpu", "--stream", "false"])
    printed = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == printed and printed.strip()


@pytest.mark.parametrize("device", ["cuda:7", "mps", "gpu"])
def test_a_device_this_machine_lacks_is_refused_by_name(device, export_dir, capsys, monkeypatch):
    from tidar_convert.cli import main

    if device == "mps":
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("a machine with 8 GPUs has cuda:7")
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(export_dir), "--prompt", "x", "--device", device])
    err = capsys.readouterr().err
    assert f"--device {device}" in err or f"--device '{device}'" in err, err


def test_an_exports_generation_config_json_keeps_tidars_options(export_dir, tmp_path):
    """transformers drops unknown fields from a generation_config.json marked as made from
    config.json: the export writes it as a generation config of its own, so the options hold."""
    import json
    import shutil

    from tidar_convert.exports.folder import load

    copy = shutil.copytree(export_dir, tmp_path / "copy")
    path = copy / "generation_config.json"
    config = json.loads(path.read_text())
    assert config.get("_from_model_config") is False
    path.write_text(json.dumps({**config, "drafter": "lookup", "siblings": 0}))
    model = load(copy)
    assert (model.generation_config.drafter, model.generation_config.siblings) == ("lookup", 0)
    model.generate(torch.tensor([[3, 4, 5, 6, 3, 4, 5]]), max_new_tokens=8, eos_token_id=None)
    assert sources(model) <= {"lookup"}
