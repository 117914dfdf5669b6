"""quality.py: repetition metrics on hand-made token lists, the pass@1 harness on tiny problems, the
verdict."""

from __future__ import annotations

import time

import pytest

from tidar_convert.bench import quality as q
from tidar_convert.runtime.spec import TiDARSpec

# ---------------------------------------------------------------------------------------------
# distinct-2 and the loop detector.
# ---------------------------------------------------------------------------------------------


def test_distinct_n():
    assert q.distinct_n([1, 2, 3, 4]) == 1.0  # 3 bigrams, all different
    assert q.distinct_n([5, 5, 5, 5, 5]) == 0.25  # 4 bigrams, one kind
    assert q.distinct_n([1, 2, 1, 2, 1]) == 0.5  # (1,2) (2,1) (1,2) (2,1)
    assert q.distinct_n([1, 2, 1, 2, 1], n=3) == 2 / 3  # (1,2,1) (2,1,2) (1,2,1)
    # no bigram: nothing said, no reward
    assert q.distinct_n([7]) == 0.0 and q.distinct_n([]) == 0.0
    # per output, then averaged
    assert q.mean_distinct2([[1, 2, 3], [5, 5, 5, 5, 5]]) == (1.0 + 0.25) / 2


def varied(n, start=100):
    return list(range(start, start + n))


@pytest.mark.parametrize("period", [1, 3, 8])
def test_periodic_tail_is_a_loop(period):
    cycle = varied(period, start=500)
    tokens = varied(80) + cycle * (60 // period + 1)  # varied text, then stuck
    assert q.ends_in_loop(tokens)


def test_period_9_is_not_a_loop():
    assert not q.ends_in_loop(varied(9) * 20)
    assert q.ends_in_loop(varied(9) * 20, max_period=9)


def test_loop_early_but_varied_tail_is_not_a_loop():
    assert not q.ends_in_loop([1, 2] * 40 + varied(48))
    # one fresh token breaks the period at the end
    assert not q.ends_in_loop([1, 2] * 40 + varied(1))


def test_short_outputs_are_not_loops():
    # shorter than the 48-token tail: it stopped at EOS by itself
    assert not q.ends_in_loop([3] * 47)
    assert q.ends_in_loop([3] * 48)
    assert not q.ends_in_loop([])
    assert q.ends_in_loop([3] * 10, tail=10)


def test_loop_share():
    assert q.loop_share([[3] * 60, varied(60), varied(10), [1, 2, 3] * 20]) == 0.5
    with pytest.raises(ValueError):
        q.loop_share([])


# ---------------------------------------------------------------------------------------------
# HumanEval pass@1 harness.
# ---------------------------------------------------------------------------------------------

PROBLEMS = {
    "Tiny/add": {
        "task_id": "Tiny/add",
        "prompt": 'def add(a, b):\n    """Sum of a and b."""\n',
        "entry_point": "add",
        "test": (
            "def check(candidate):\n    assert candidate(2, 3) == 5\n"
            "    assert candidate(-1, 1) == 0\n"
        ),
    },
    "Tiny/rev": {
        "task_id": "Tiny/rev",
        "prompt": 'def rev(s):\n    """s reversed."""\n',
        "entry_point": "rev",
        "test": "def check(candidate):\n    assert candidate('abc') == 'cba'\n",
    },
    "Tiny/spin": {
        "task_id": "Tiny/spin",
        "prompt": 'def spin(x):\n    """x, eventually."""\n',
        "entry_point": "spin",
        "test": "def check(candidate):\n    assert candidate(1) == 1\n",
    },
}


def test_pass_at_1_solved_unsolved_and_timeout():
    completions = {
        # cut at the stop sequence
        "Tiny/add": "    return a + b\n\ndef unrelated():\n    raise SystemError\n",
        "Tiny/rev": "    return s\n",  # wrong
        "Tiny/spin": "    while True:\n        pass\n",  # never returns: killed by the timeout
    }
    t0 = time.perf_counter()
    r = q.humaneval_pass_at_1(completions, PROBLEMS, timeout=2.0, workers=3)
    assert time.perf_counter() - t0 < 15  # the spinning program is killed, not waited for
    assert r["results"]["Tiny/add"] == "passed"
    assert r["results"]["Tiny/rev"] == "failed: AssertionError"
    assert r["results"]["Tiny/spin"] == "timed out"
    assert (r["passed"], r["total"]) == (1, 3) and r["pass@1"] == pytest.approx(1 / 3)


def test_exiting_early_is_not_a_pass():
    r = q.humaneval_pass_at_1({"Tiny/add": "    import sys; sys.exit(0)\n"}, PROBLEMS, timeout=5.0)
    assert r["results"]["Tiny/add"] != "passed" and r["pass@1"] == 0.0


def test_pass_at_1_rejects_unknown_problems():
    with pytest.raises(ValueError, match="unknown"):
        q.humaneval_pass_at_1({"Tiny/nope": "    pass\n"}, PROBLEMS)


def test_truncate_at_stop_sequences():
    body = "    return a + b\n"
    for tail in (
        "\ndef f():\n    pass",
        "\nclass A:\n    pass",
        "\nif __name__ == '__main__':\n    x",
        "\nprint(add(1, 2))",
        "\n# test\n",
    ):
        assert q.truncate(body + tail) == body
    assert q.truncate(body + "\n\n\ndef g(): pass\n# x") == body + "\n\n"  # the earliest stop wins
    nested = "    def helper(x):\n        return x\n    # why\n    return helper(a) + b\n"
    assert q.truncate(nested) == nested  # indented defs and comments belong to the body
    assert q.truncate("") == ""


# ---------------------------------------------------------------------------------------------
# The verdict.
# ---------------------------------------------------------------------------------------------

GOOD = [varied(60), varied(60, start=300)]  # distinct-2 1.0, no loops
LOOPY = [[3] * 60, varied(60)]  # distinct-2 (1/59 + 1) / 2, half loop


def test_report_passes_when_as_good_as_the_base():
    r = q.quality_report(GOOD, GOOD, converted_pass1=0.40, base_pass1=0.41)  # within one point
    assert r["passes"] and r["reasons"] == []
    assert r["distinct2_ratio"] == 1.0 and r["loop_share_change"] == 0.0
    assert r["pass@1_change_points"] == pytest.approx(-1.0)
    assert q.quality_report(GOOD, GOOD)["passes"]  # without HumanEval: the text rules only


def test_report_distinct2_alone_can_fail():
    lower = [[1, 2, 3, 4, 5, 6] * 6 + varied(12)] * 2  # repetitive but not ending in a loop
    assert q.loop_share(lower) == 0.0 and q.mean_distinct2(lower) < 0.9
    r = q.quality_report(lower, GOOD, 0.5, 0.5)
    assert not r["passes"] and len(r["reasons"]) == 1 and "distinct-2" in r["reasons"][0]


def test_report_loop_share_alone_can_fail():
    # a long varied text that ends stuck: distinct-2 stays high
    one_loop = [varied(200) + [7] * 48, varied(100)]
    r = q.quality_report(one_loop + GOOD, GOOD + GOOD, 0.5, 0.5)
    assert r["converted"]["distinct2"] >= 0.9 * r["base"]["distinct2"]
    assert not r["passes"] and len(r["reasons"]) == 1 and "loop share" in r["reasons"][0]
    # a loop share no higher than the base's is fine
    assert q.quality_report(LOOPY, LOOPY)["passes"]


def test_report_pass_at_1_alone_can_fail():
    r = q.quality_report(GOOD, GOOD, converted_pass1=0.38, base_pass1=0.40)
    assert not r["passes"] and len(r["reasons"]) == 1 and "pass@1" in r["reasons"][0]
    # exactly 1 point down
    assert q.quality_report(GOOD, GOOD, converted_pass1=0.49, base_pass1=0.50)["passes"]


def test_report_needs_pass_at_1_for_both_or_neither():
    with pytest.raises(ValueError, match="both"):
        q.quality_report(GOOD, GOOD, converted_pass1=0.5)


# ---------------------------------------------------------------------------------------------
# `tidar-convert quality` on a tiny export of a tiny random model.
# ---------------------------------------------------------------------------------------------


def test_quality_cli_writes_a_report(tiny_dirs, tmp_path, capsys):
    import json

    from tidar_convert.cli import main
    from tidar_convert.exports.folder import export
    from tidar_convert.models.loading import load_base

    m, tok = load_base(str(tiny_dirs["llama"]))
    path = export(m, tok, tmp_path / "tiny", TiDARSpec(4))
    out = tmp_path / "report.json"
    main(
        [
            "quality",
            "--model",
            str(path),
            "--base",
            str(tiny_dirs["llama"]),
            "--limit",
            "2",
            "--max-new-tokens",
            "8",
            "--out",
            str(out),
        ]
    )
    assert f"wrote {out}" in capsys.readouterr().err
    r = json.loads(out.read_text())
    assert r["prompts"] == 2 and r["humaneval_problems"] == 1 and isinstance(r["passes"], bool)
    assert [row["kind"] for row in r["rows"]] == ["code", "text"]
    # a random model does not solve HumanEval/0
    assert r["rows"][0]["converted"]["humaneval"] != "passed"
    for side in ("converted", "base"):
        assert set(r[side]) == {"distinct2", "loop_share", "pass@1"} and r[side]["pass@1"] == 0.0
        assert all(row[side]["new_tokens"] <= 8 for row in r["rows"])


def test_quality_cli_defaults_to_the_base_the_export_records(tiny_dirs, tmp_path):
    import json

    from tidar_convert.cli import main
    from tidar_convert.exports.folder import export
    from tidar_convert.models.loading import load_base

    m, tok = load_base(str(tiny_dirs["qwen2"]))
    path = export(
        m,
        tok,
        tmp_path / "tiny",
        TiDARSpec(4),
        card={"base_model": str(tiny_dirs["qwen2"])},
    )
    out = tmp_path / "report.json"
    base_text = {}
    for base_decoder in ("prompt_lookup", "ar"):
        main(
            [
                "quality",
                "--model",
                str(path),
                "--limit",
                "2",
                "--max-new-tokens",
                "8",
                "--humaneval",
                "false",
                "--out",
                str(out),
                "--base-decoder",
                base_decoder,
                "--overwrite",
            ]
        )
        r = json.loads(out.read_text())
        # not overwritten by the base metrics
        assert r["base_model"] == str(tiny_dirs["qwen2"].resolve())
        assert r["base_decoder"] == base_decoder
        # untrained export: the base's own weights, the same text
        assert r["passes"] and r["distinct2_ratio"] == 1.0
        base_text[base_decoder] = [row["base"]["text"] for row in r["rows"]]
    # the fast default writes the base's greedy text
    assert base_text["prompt_lookup"] == base_text["ar"]
