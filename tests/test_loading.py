import pytest
import torch
from helpers import FAMILIES
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidar_convert.models.loading import (
    MASK_TOKEN,
    PAD_TOKEN,
    add_tidar_tokens,
    check_architecture,
    load_base,
    resolve,
)


@pytest.mark.parametrize("family", FAMILIES)
def test_mask_and_pad_tokens_added(tiny_dirs, family):
    base = AutoModelForCausalLM.from_pretrained(tiny_dirs[family])
    old = base.get_input_embeddings().weight.detach().clone()
    model, tok = load_base(str(tiny_dirs[family]))
    assert tok.mask_token == MASK_TOKEN  # the tiny tokenizer has none
    emb = model.get_input_embeddings().weight
    assert tok.pad_token is not None and model.config.pad_token_id == tok.pad_token_id
    # + mask (+ pad), minus <|endoftext|>
    assert emb.shape[0] == len(tok) == old.shape[0] + len(tok.get_added_vocab()) - 1
    assert (
        model.config.mask_token_id == tok.mask_token_id
        and model.config.pad_token_id == tok.pad_token_id
    )
    torch.testing.assert_close(emb[: old.shape[0]], old)  # existing rows untouched
    # the new row starts near the mean of the old ones, not at some random far-away point
    assert (emb[tok.mask_token_id] - old.mean(0)).norm() < old.std(0).norm() * 3
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    assert tok(MASK_TOKEN, add_special_tokens=False)["input_ids"] == [tok.mask_token_id]


def test_missing_pad_token_is_added(tiny_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    tok.pad_token = None
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    add_tidar_tokens(model, tok)
    assert tok.pad_token == PAD_TOKEN and model.config.pad_token_id == tok.pad_token_id
    assert model.get_input_embeddings().num_embeddings == len(tok)


def test_existing_mask_and_pad_tokens_are_reused(tiny_dirs, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    tok.mask_token = tok.pad_token = "<|endoftext|>"
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    n = model.get_input_embeddings().num_embeddings
    add_tidar_tokens(model, tok)
    assert model.get_input_embeddings().num_embeddings == n
    assert model.config.mask_token_id == tok.convert_tokens_to_ids("<|endoftext|>")


def test_unsupported_architectures_are_refused():
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="BloomForCausalLM.*no position_ids"):  # ALiBi
        check_architecture(AutoConfig.for_model("bloom", architectures=["BloomForCausalLM"]))
    with pytest.raises(ValueError, match="not a decoder-only causal LM"):
        check_architecture(AutoConfig.for_model("t5"))
    with pytest.raises(ValueError, match="not a decoder-only causal LM"):
        check_architecture(AutoConfig.for_model("vit"))


def test_unsupported_model_folder_is_refused_by_name(tmp_path):
    from transformers import BloomConfig, BloomForCausalLM

    BloomForCausalLM(
        BloomConfig(n_layer=1, hidden_size=16, n_head=2, vocab_size=50)
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="BloomForCausalLM .*has no position_ids"):
        load_base(str(tmp_path))


def test_missing_paths_are_clear():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve("/no/such/model.gguf")
    with pytest.raises(FileNotFoundError, match="neither an existing path nor a hub id"):
        resolve("./no/such/folder")


@pytest.mark.parametrize("family", FAMILIES)
def test_config_and_tokenizer_alone_agree_with_the_loaded_model(tiny_dirs, family):
    """The module reads these before any weight (the model is built later, where the strategy wants
    it): the token ids must be the ones the loaded model gets."""
    from tidar_convert.models.loading import load_config_and_tokenizer

    config, tok = load_config_and_tokenizer(str(tiny_dirs[family]))
    model, tok_loaded = load_base(str(tiny_dirs[family]))
    assert config.model_type == model.config.model_type == family
    assert (tok.mask_token_id, tok.pad_token_id, len(tok)) == (
        model.config.mask_token_id,
        model.config.pad_token_id,
        len(tok_loaded),
    )
    assert len(tok) == model.get_input_embeddings().num_embeddings


def test_same_model_reads_each_spelling_of_a_base_model(tiny_dirs, tmp_path, monkeypatch):
    from tidar_convert.models.loading import absolute_model, same_model

    folder = tiny_dirs["llama"]
    monkeypatch.chdir(folder.parent)
    assert (
        absolute_model(f"./{folder.name}") == str(folder)
        and absolute_model("Org/model") == "Org/model"
        and absolute_model(None) is None
    )
    assert (
        same_model(f"./{folder.name}", str(folder))
        and same_model(None, "default")
        and same_model("embedded", "")
    )
    (tmp_path / "link").symlink_to(folder)
    assert same_model(str(tmp_path / "link"), str(folder))
    assert (
        not same_model(str(folder), str(tiny_dirs["qwen2"]))
        and not same_model(str(folder), None)
        and not same_model("Org/a", "Org/b")
    )
