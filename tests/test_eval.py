"""lm-evaluation-harness on an export, as a user runs it: `--model hf --model_args
pretrained=OUT,...`.

trust_remote_code=True (TiDAR generate, the export's custom_generate) against the same folder
without it (transformers' AR generate), on tiny local tasks: loglikelihoods identical (both are
one plain causal pass) and generate_until outputs identical at batch size 1 and 4 (batch 4: lm-eval
left-pads, TiDAR decodes the padded batch). Offline: JSON-lines datasets in a temporary folder.

Two exports: `trained` learned a token cycle, so TiDAR's drafts are accepted (several tokens per
forward pass); `random` is untrained, so every token it picks depends on the whole context and its
positions: a TiDAR that mishandled the left padding would not match AR there (checked: ignoring
the attention mask in generate.py passes on `trained` and fails on `random` at batch 4).

Needs the `eval` extra (`pip install -e ".[eval]"`); `make test` installs it, so CI runs this.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tidar_convert import export
from tidar_convert.runtime.spec import TiDARSpec

# CI installs the extra (make test): there a missing lm-eval fails, never skips
if os.environ.get("CI"):
    import lm_eval  # noqa: F401
else:
    pytest.importorskip(
        "lm_eval", reason='the `eval` extra is not installed: pip install -e ".[eval]"'
    )

CYCLE = (
    "#$%&'()"  # tokens 3..9 of the test tokenizer, one character each: the cycle the model learned
)


def cycle_text(phase: int, n: int) -> str:
    return "".join(CYCLE[(phase + i) % len(CYCLE)] for i in range(n))


# (phase, length): lengths differ so that every batch of 4 is left-padded.
CONTEXTS = [(0, 5), (3, 9), (5, 12), (1, 7), (2, 6), (6, 11), (4, 8), (0, 10)]

TASKS = {
    # loglikelihood: the right continuation, a plausible wrong one, and one the model never saw
    "tidar_tiny_mc": {
        "docs": [
            {
                "context": cycle_text(p, n),
                "choices": [cycle_text(p + n, 3), cycle_text(p + n + 2, 3), "abc"],
                "label": 0,
            }
            for p, n in CONTEXTS
        ],
        "yaml": """
            output_type: multiple_choice
            doc_to_text: "{{context}}"
            doc_to_choice: "{{choices}}"
            doc_to_target: label
            metric_list:
              - metric: acc
                aggregation: mean
                higher_is_better: true
        """,
    },
    # generate_until, never stopping early: max_gen_toks per row (several TiDAR steps)
    "tidar_tiny_gen": {
        "docs": [
            {"context": cycle_text(p, n), "target": cycle_text(p + n, 20)} for p, n in CONTEXTS
        ],
        "yaml": """
            output_type: generate_until
            doc_to_text: "{{context}}"
            doc_to_target: "{{target}}"
            generation_kwargs:
              until: ["\\n\\n"]
              max_gen_toks: 20
              do_sample: false
            metric_list:
              - metric: exact_match
                aggregation: mean
                higher_is_better: true
        """,
    },
    # generate_until with a stop string each row meets at a different step (rows finish apart)
    "tidar_tiny_stop": {
        "docs": [{"context": cycle_text(p, n), "target": ""} for p, n in CONTEXTS],
        "yaml": """
            output_type: generate_until
            doc_to_text: "{{context}}"
            doc_to_target: "{{target}}"
            generation_kwargs:
              until: ["&'("]
              max_gen_toks: 20
              do_sample: false
            metric_list:
              - metric: exact_match
                aggregation: mean
                higher_is_better: true
        """,
    },
}

# One interpreter runs all four evaluations, the way a user's script would, with a spy on HFLM's
# generate call: which generate ran, the batch shape and padding, and TiDAR's stats after it.
SCRIPT = """
import json, sys
import lm_eval
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

exports, include, tasks = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
calls = []
real = HFLM._model_generate

def spy(self, context, max_length, stop, **kwargs):
    result = real(self, context, max_length, stop, **kwargs)
    fn = getattr(self.model.generate, "func", self.model.generate)
    mask = kwargs.get("attention_mask")
    stats = getattr(self.model, "tidar_stats", None)
    calls.append({"generate": fn.__module__, "rows": context.shape[0],
                  "left_padded": bool(mask is not None and (mask[:, 0] == 0).any()),
                  "new_tokens": stats["new_tokens"] if stats else None,
                  "tokens_per_nfe": stats["tokens_per_nfe"] if stats else None})
    return result

HFLM._model_generate = spy
manager = TaskManager(include_path=include, include_defaults=False)
runs = {}
for name, out in exports.items():
  for trust in (True, False):
    for batch in (1, 4):
        calls.clear()
        model_args = f"pretrained={out},trust_remote_code={trust},dtype=float32"
        r = lm_eval.simple_evaluate(model="hf", model_args=model_args, tasks=tasks,
                                    batch_size=batch, device="cpu", task_manager=manager,
                                    log_samples=True, bootstrap_iters=0)
        runs[f"{name}/{'tidar' if trust else 'ar'}/{batch}"] = {
            "resps": {t: [s["resps"] for s in sorted(r["samples"][t], key=lambda s: s["doc_id"])]
                      for t in tasks},
            "filtered": {t: [s["filtered_resps"]
                             for s in sorted(r["samples"][t], key=lambda s: s["doc_id"])]
                         for t in tasks},
            "calls": list(calls),
        }
print("RESULT " + json.dumps(runs))
"""


@pytest.fixture(scope="module")
def runs(trained, tiny_dirs, tmp_path_factory):
    from tidar_convert.models.loading import load_base

    root = tmp_path_factory.mktemp("lm_eval")
    exports = {"trained": str(export(*trained["qwen3"], root / "trained", TiDARSpec(4)))}
    exports["random"] = str(
        export(*load_base(str(tiny_dirs["qwen3"])), root / "random", TiDARSpec(4))
    )
    tasks = root / "tasks"
    tasks.mkdir()
    for name, task in TASKS.items():
        data = tasks / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in task["docs"]))
        head = (
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f'    test: {data}\ntest_split: test\ntarget_delimiter: ""\n'
        )
        (tasks / f"{name}.yaml").write_text(head + textwrap.dedent(task["yaml"]).lstrip())
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(root / "datasets"),
        "HF_MODULES_CACHE": str(root / "hf_modules"),
    }
    cmd = [sys.executable, "-c", SCRIPT, json.dumps(exports), str(tasks), ",".join(TASKS)]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, env=env, stdin=subprocess.DEVNULL
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.rsplit("RESULT ", 1)[-1])


MODELS = ["trained", "random"]


@pytest.mark.subprocess
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("model", MODELS)
def test_loglikelihood_identical(runs, model, batch):
    tidar, ar = runs[f"{model}/tidar/{batch}"], runs[f"{model}/ar/{batch}"]
    assert tidar["resps"]["tidar_tiny_mc"] == ar["resps"]["tidar_tiny_mc"]
    if model == "trained":  # and they are real scores: the learned continuation wins every time
        assert all(
            max(range(3), key=lambda i: doc[i][0][0]) == 0
            for doc in tidar["resps"]["tidar_tiny_mc"]
        )


@pytest.mark.subprocess
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("model", MODELS)
def test_generate_until_identical(runs, model, batch):
    tidar, ar = runs[f"{model}/tidar/{batch}"], runs[f"{model}/ar/{batch}"]
    for task in ("tidar_tiny_gen", "tidar_tiny_stop"):
        assert tidar["resps"][task] == ar["resps"][task], task
        assert tidar["filtered"][task] == ar["filtered"][task], task
    gens = [doc[0][0] for doc in tidar["resps"]["tidar_tiny_gen"]]
    assert len(set(gens)) > 1 and all(gens), gens
    if model == "trained":
        assert all(len(g) >= 20 for g in gens), gens  # 20 one-character tokens each, no early stop
        stops = [doc[0][0] for doc in tidar["resps"]["tidar_tiny_stop"]]
        # cut where each row met the stop
        assert len({len(s) for s in stops}) > 1 and all("&'(" not in s for s in stops), stops


@pytest.mark.subprocess
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("model", MODELS)
def test_trust_remote_code_is_what_switches_tidar_on(runs, model, batch):
    """Otherwise "identical" could mean both ran AR: the TiDAR runs must really be TiDAR."""
    tidar, ar = runs[f"{model}/tidar/{batch}"]["calls"], runs[f"{model}/ar/{batch}"]["calls"]
    assert tidar and all(
        c["generate"].endswith("custom_generate.generate") and c["tokens_per_nfe"] for c in tidar
    )
    assert ar and all(
        c["generate"] == "transformers.generation.utils" and c["tokens_per_nfe"] is None for c in ar
    )
    assert {c["rows"] for c in tidar} == {batch}
    # drafts accepted: several tokens a forward pass (AR: 1.0; the cost plan, the default, may
    # verify fewer where they would not pay)
    if model == "trained":
        # (a row that meets the stop string at once makes 3 tokens in 2 passes)
        long = [c for c in tidar if c["new_tokens"] >= 8]
        assert long and all(c["tokens_per_nfe"] > 1.5 for c in long), [
            (c["new_tokens"], c["rows"], c["tokens_per_nfe"]) for c in tidar
        ]
    if batch == 4:
        assert any(c["left_padded"] for c in tidar), (
            "lm-eval sent no padded batch: the batch case is not tested"
        )
