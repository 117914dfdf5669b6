"""TiDARSpec: one validated object, written to and read from the config in one place; exports
and checkpoints written before the draft length was renamed (block_size) still load and decode."""

import json
import math
import shutil

import pytest
import torch
from helpers import train_tiny

from tidar_convert import export, load
from tidar_convert.exports.folder import check_export
from tidar_convert.runtime.spec import TiDARSpec, check_draft_length
from tidar_convert.train.recipe import suggestion
from tidar_convert.train.resume import migrate


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"draft_length": 1}, "draft_length=1"),
        ({"draft_length": 0}, "draft_length=0"),
        ({"draft_length": True}, "draft_length=True"),
        ({"draft_length": 2.5}, "draft_length=2.5"),
        ({"draft_length": 4, "mask_token_id": -1}, "mask_token_id=-1"),
        ({"draft_length": 4, "alpha": -1.0}, "alpha=-1.0"),
        ({"draft_length": 4, "alpha": math.nan}, "alpha=nan"),
        ({"draft_length": 4, "adapter": {"scope": "masks"}}, "names no file"),
    ],
)
def test_a_spec_refuses_what_means_nothing(fields, named):
    with pytest.raises(ValueError, match=named):
        TiDARSpec(**fields)


def test_the_draft_length_has_one_check_that_names_the_flag():
    assert check_draft_length(2) == 2
    with pytest.raises(ValueError, match=r"--draft-length=1: TiDAR drafts at least 2 tokens"):
        check_draft_length(1, "--draft-length")


def test_a_spec_round_trips_through_a_config_and_its_json():
    from transformers import LlamaConfig

    config = LlamaConfig()
    spec = TiDARSpec(8, 5, 0.5, adapter={"file": "a.safetensors"}, base_model="org/base")
    spec.write(config)
    assert config.mask_token_id == 5 and config.tidar["draft_length"] == 8
    assert TiDARSpec.from_config(config) == spec
    assert TiDARSpec.from_config(json.loads(config.to_json_string())) == spec
    with pytest.raises(ValueError, match=r"holds \['speculator'\].*upgrade tidar-convert"):
        TiDARSpec.from_config({"tidar": {"draft_length": 4, "speculator": 1}})
    assert TiDARSpec.from_config(LlamaConfig()) is None


def test_the_first_format_is_read_and_a_base_configs_own_block_size_is_not_taken_for_it():
    old = {
        "block_size": 4,
        "alpha": 1.0,
        "mask_token_id": 7,
        "tidar_adapter": {"scope": "masks", "file": "tidar_adapter.safetensors"},
        "tidar_base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    }
    spec = TiDARSpec.from_config(old)
    assert (spec.draft_length, spec.mask_token_id, spec.alpha) == (4, 7, 1.0)
    assert spec.mask_scoped and spec.base_model == old["tidar_base_model"]
    # a base model may call its own context length block_size: that alone is no TiDAR spec
    assert TiDARSpec.from_config({"block_size": 1024, "model_type": "x"}) is None


@pytest.fixture(scope="module")
def old_export(tiny_dirs, tmp_path_factory):
    """An export whose config.json is in the format written before 2026-12-06."""
    from tidar_convert.models.loading import load_base

    model, tok = load_base(str(tiny_dirs["llama"]))
    train_tiny(model, steps=60)
    out = export(model, tok, tmp_path_factory.mktemp("spec") / "new", TiDARSpec(4))
    old = out.parent / "old"
    shutil.copytree(out, old)
    cfg = json.loads((old / "config.json").read_text())
    tidar = cfg.pop("tidar")
    cfg.update(block_size=tidar["draft_length"], alpha=tidar["alpha"])
    cfg["tidar_base_model"] = "some/base"
    (old / "config.json").write_text(json.dumps(cfg))
    return out, old


def test_an_export_of_the_first_format_loads_and_decodes_exactly(old_export):
    new, old = old_export
    spec = check_export(old)
    assert spec.draft_length == 4 and spec.base_model == "some/base"
    assert check_export(new).draft_length == 4
    model = load(old)
    ids = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 1, 2]])
    tidar = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert model.tidar_stats["tokens_per_nfe"] > 1  # the drafts were read at the trained length
    assert torch.equal(tidar, model.generate(ids, max_new_tokens=24, do_sample=False, tidar=False))
    assert torch.equal(tidar, load(new).generate(ids, max_new_tokens=24, do_sample=False))


def test_generate_takes_the_old_keyword_with_a_warning(old_export):
    model = load(old_export[0])
    ids = torch.tensor([[1, 2, 3, 4, 1, 2]])
    want = model.generate(ids, max_new_tokens=8, do_sample=False, draft_length=3)
    with pytest.warns(FutureWarning, match="renamed draft_length"):
        got = model.generate(ids, max_new_tokens=8, do_sample=False, block_size=3)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="draft_length only"):
        model.generate(ids, max_new_tokens=8, draft_length=3, block_size=3)


def test_old_checkpoints_and_flags_are_read_under_the_new_name():
    assert migrate({"block_size": 8, "val_decode_block_size": 4, "lr": 1}) == {
        "draft_length": 8,
        "val_decode_draft_length": 4,
        "lr": 1,
    }
    keys = ["--model.draft_length", "--model.alpha"]
    said = suggestion("error: unrecognized arguments: --model.block_size 8", keys)
    assert "--model.block_size is now --model.draft_length" in said
