"""Fixtures: tiny random models of each supported family saved as local folders, a tiny BPE
tokenizer, trained and untrained models (built with helpers.py)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import FAMILIES, tiny_config, tiny_tokenizer, train_tiny

from tidar_convert.runtime.spec import TiDARSpec

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, tokenizer):
    """{family: folder} of tiny random base models (not yet converted), saved with the tokenizer."""
    from transformers import AutoModelForCausalLM

    out = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(family, len(tokenizer)))
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        out[family] = path
    return out


@pytest.fixture(scope="session")
def trained(tiny_dirs):
    """{family: (model, tokenizer)}: tiny TiDAR models whose diffusion head drafts the
    cycle well."""
    from tidar_convert.models.loading import load_base

    out = {}
    for family in FAMILIES:
        model, tok = load_base(str(tiny_dirs[family]))
        out[family] = (train_tiny(model), tok)
    return out


@pytest.fixture(scope="module")
def untrained(tiny_dirs):
    """{family: model}: tiny models with untrained diffusion heads (one copy per test module, which
    may set draft_length)."""
    from tidar_convert.models.loading import load_base

    models = {f: load_base(str(tiny_dirs[f]))[0].eval() for f in FAMILIES}
    for m in models.values():
        TiDARSpec(4, m.config.mask_token_id).write(m.config)
    return models


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if fit gets as far as reading a model."""

    def loaded(*a, **k):
        raise AssertionError("the model was read before the bad setting was refused")

    monkeypatch.setattr("tidar_convert.train.fit.check_model", loaded)
