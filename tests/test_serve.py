"""An export served by `transformers serve --trust-remote-code` (the `serve` extra): the OpenAI API,
streaming and not, `max_tokens` and a stop sequence, answered by TiDAR's generate() with the text
plain AR writes. The server listens on loopback only and every wait is bounded."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tidar_convert.bench.serve import stop_server
from tidar_convert.runtime.spec import TiDARSpec

pytestmark = pytest.mark.subprocess

MESSAGES = [{"role": "user", "content": "def f(x):\n    return x"}]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # the tiny tokenizer has none
)


@pytest.fixture(scope="module")
def served_export(trained, tmp_path_factory):
    from tidar_convert.exports.folder import export

    model, tok = trained["llama"]  # drafts the cycle the prompt below starts
    tok.chat_template = CHAT_TEMPLATE
    try:
        out = export(model, tok, tmp_path_factory.mktemp("serve") / "tidar", TiDARSpec(4))
    finally:
        tok.chat_template = None
    # TiDAR's options in the export's generation_config.json reach the served generate(): the
    # default drafter would draft this repeating text by lookup, this one by diffusion only
    config = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**config, "drafter": "diffusion"}))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(served_export, tmp_path_factory):
    """`transformers serve` on a free loopback port with the export preloaded; its log file."""
    port, log = free_port(), tmp_path_factory.mktemp("serve-log") / "server.log"
    cli = Path(sys.executable).with_name("transformers")
    cmd = [
        str(cli),
        "serve",
        "--trust-remote-code",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--log-level",
        "info",
        str(served_export),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (
                f"the server exited with {proc.returncode}:\n{log.read_text()}"
            )
            assert time.monotonic() < deadline, (
                f"the server did not answer /health in 180 s:\n{log.read_text()}"
            )
            time.sleep(1)
        yield proc, port, log
    finally:
        stop_server(proc)  # SIGTERM (uvicorn shuts down gracefully), a kill after 30 s


def reference(export: Path, max_new_tokens: int) -> str:
    """What plain AR writes for the chat prompt: the export without its remote code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export)
    ids = tok.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_chat_completions_are_tidar_and_write_what_ar_writes(server, served_export):
    import openai

    proc, port, log = server
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0
    )
    ask = dict(model=str(served_export), messages=MESSAGES, temperature=0)
    expected = reference(served_export, 32)
    assert len(expected) > 8, expected

    answer = client.chat.completions.create(max_tokens=32, **ask)
    assert answer.choices[0].message.content == expected
    assert answer.usage.completion_tokens == 32  # max_tokens, as asked (no EOS in the cycle)

    streamed = client.chat.completions.create(max_tokens=32, stream=True, **ask)
    assert (
        "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
        == expected
    )

    # a stop sequence inside the text: generation stops where AR's text first holds it
    stop = expected[4:7]
    cut = (
        client.chat.completions.create(max_tokens=32, stop=[stop], **ask).choices[0].message.content
    )
    # transformers serve returns the text through the stop sequence (stop_strings), not before it as
    # OpenAI does
    assert cut == expected[: expected.index(stop) + len(stop)], (cut, stop, expected)

    # TiDAR's generate() answered (its log line), and drafted: more than one token per forward pass
    ran = [
        float(m)
        for m in re.findall(
            r"TiDAR generate: \d+ new tokens in \d+ forward passes \(([\d.]+) tokens per forward",
            log.read_text(),
        )
    ]
    assert len(ran) >= 3 and max(ran) > 1.0, log.read_text()
    # with the drafter its generation_config.json names (served_export)
    lookup = re.findall(r"drafts by source \{'lookup': (\d+), 'diffusion': (\d+)", log.read_text())
    assert len(lookup) >= 3 and all(n == "0" for n, _ in lookup), log.read_text()
    assert any(int(d) > 0 for _, d in lookup), log.read_text()


def test_bench_serve_measures_tidar_against_ar_on_one_server(served_export, tmp_path, capsys):
    """`tidar-convert bench-serve` with tiny counts: one server answers both modes, TiDAR turned off
    per request through its generation config; the JSON holds tokens/s per mode and client count."""
    import json

    from tidar_convert.cli import main

    out = tmp_path / "serve.json"
    main(
        [
            "bench-serve",
            "--model",
            str(served_export),
            "--clients",
            "[1,2]",
            "--requests",
            "2",
            "--max-tokens",
            "8",
            "--out",
            str(out),
        ]
    )
    r = json.loads(out.read_text())
    assert (
        r["clients"] == [1, 2]
        and r["requests"] == 2
        and r["max_tokens"] == 8
        and r["prompt_set"] == "chat"
    )
    assert set(r["results"]) == {"1", "2"} and not r["cut_by_time_limit"]
    for n, part in r["results"].items():
        for mode in ("tidar", "ar"):
            m = part[mode]
            assert (
                m["requests"] == 2
                and m["completion_tokens"] == 16
                and m["tokens_per_s"] > 0
                and m["seconds"] > 0
            ), (n, mode)
            assert [run["prompt"] for run in m["runs"]] == [0, 1]
        # greedy: the served texts are AR's
        assert part["tidar_vs_ar"] > 0 and part["identical"] == 2
    # TiDAR answered exactly the TiDAR requests: its log line for each, none for the requests sent
    # with tidar false
    assert r["served_tidar"]["calls"] == 4 and r["served_tidar"]["new_tokens"] == 32
    assert Path(r["log"]).exists() and "Application shutdown complete" in Path(r["log"]).read_text()
    err = capsys.readouterr().err
    assert "1 client(s): TiDAR" in err and f"wrote {out}" in err


def test_the_server_stops_cleanly(server):
    proc, port, log = server
    proc.send_signal(signal.SIGTERM)  # what a service manager sends
    code = proc.wait(timeout=30)
    text = log.read_text()
    # uvicorn shuts down, then re-raises the signal it handled: -SIGTERM after a graceful stop
    assert (
        code in (0, -signal.SIGTERM)
        and "Application shutdown complete" in text
        and "Finished server process" in text
    ), (code, text)
    assert "Traceback" not in text, text
