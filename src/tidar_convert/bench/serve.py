"""`tidar-convert bench-serve`: tokens/s of an export as served by `transformers serve`, TiDAR
against the same server with TiDAR off, for 1 and more concurrent clients.

One server process, started here on a loopback port, answers both modes: each request carries a
generation config (the request's `generation_config` JSON, which `transformers serve` builds the
call's GenerationConfig from) with `tidar` true or false, so the weights, the process and its
warm state are the same and only the decoding differs. The modes alternate per client count, so
noise on a shared machine hits both alike. The load is bounded: a fixed number of requests per
(mode, clients) and a wall-clock limit for the whole run, after which no new request starts.

`transformers serve` without --continuous-batching runs model.generate on one inference thread, a
request at a time: more clients queue, they are not batched (the figures at 4 clients say what that
costs). With --continuous-batching TiDAR does not run at all (decode.CONTINUOUS_BATCHING_WARNING).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tidar_convert.bench.prompts import chat_prompts, check_chat_template
from tidar_convert.train.progress import Bar

MODES = ("tidar", "ar")
# decode.py's log line after every TiDAR generate(): the server's own evidence that TiDAR answered
TIDAR_LINE = re.compile(r"TiDAR generate: (\d+) new tokens in (\d+) forward passes")


def check_serve_args(
    clients: list[int], requests: int, max_tokens: int, time_limit: float, startup_timeout: float
) -> None:
    if not clients or any(not isinstance(n, int) or n < 1 for n in clients):
        raise ValueError(
            f"clients={clients!r}: pass one or more client counts >= 1, e.g. --clients [1,4]."
        )
    if requests < 1:
        raise ValueError(f"requests={requests}: must be >= 1 (requests per mode and client count).")
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: must be >= 1.")
    if time_limit <= 0 or startup_timeout <= 0:
        raise ValueError(
            f"time_limit={time_limit}, startup_timeout={startup_timeout}: both must be > 0 seconds."
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    model: Path, port: int, device: str, log: Path, timeout: float
) -> subprocess.Popen:
    """`transformers serve --trust-remote-code` on 127.0.0.1:port with the export preloaded, its
    output in `log`; returns once /health answers. Ends the process and raises if it exits or stays
    silent."""
    cli = Path(sys.executable).with_name("transformers")
    if not cli.exists():
        raise FileNotFoundError(
            f"no `transformers` command beside {sys.executable}; install the serve extra: pip "
            "install 'tidar-convert[serve]'."
        )
    cmd = [
        str(cli),
        "serve",
        "--trust-remote-code",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        device,
        "--log-level",
        "info",
        str(model),
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
        )
    start = time.monotonic()
    deadline = start + timeout
    # loading the export takes minutes for a large one: seconds waited, out of the timeout
    wait = Bar(total=round(timeout), desc="waiting for `transformers serve`", unit="s")
    while True:
        wait.update(round(time.monotonic() - start) - wait.n)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    wait.close()
                    return proc
        except OSError:
            pass
        if proc.poll() is not None:
            wait.close()
            raise ValueError(
                f"`transformers serve` exited with {proc.returncode} before answering; its log: "
                f"{log}"
            )
        if time.monotonic() > deadline:
            wait.close()
            stop_server(proc)
            raise ValueError(
                f"`transformers serve` did not answer /health in {timeout:.0f} s (raise "
                f"--startup_timeout); its log: {log}"
            )
        time.sleep(1)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # uvicorn shuts down gracefully
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def chat_request(
    port: int, model: str, text: str, max_tokens: int, tidar: bool, timeout: float
) -> dict:
    """One non-streamed, greedy /v1/chat/completions request; its text, completion tokens and
    seconds."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        # the call's whole GenerationConfig (transformers serve: GenerationConfig(**json));
        # generate() completes it with the model's, and reads `tidar` from it (decode.generate)
        "generation_config": json.dumps(
            {"tidar": tidar, "do_sample": False, "max_new_tokens": max_tokens}
        ),
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ValueError(
            f"the server refused a request ({e.code}): {e.read().decode(errors='replace')[:500]}"
        ) from e
    return {
        "text": answer["choices"][0]["message"]["content"],
        "completion_tokens": answer["usage"]["completion_tokens"],
        "seconds": time.perf_counter() - t0,
    }


def run_load(
    port: int,
    model: str,
    texts: list[str],
    clients: int,
    requests: int,
    max_tokens: int,
    tidar: bool,
    deadline: float,
    bar: Bar | None = None,
) -> dict:
    """`requests` requests from `clients` concurrent clients (prompt i for request i), none started
    past `deadline`: tokens/s over the wall time of the whole load, and each request's figures.
    `bar` counts each request as it ends (or is not started)."""
    counting = threading.Lock()  # the clients' threads count on one bar

    def one(i: int):
        left = deadline - time.monotonic()
        if left <= 0:
            answer = None  # out of time: not started
        else:
            answer = {
                "prompt": i % len(texts),
                **chat_request(
                    port, model, texts[i % len(texts)], max_tokens, tidar, timeout=max(left, 1.0)
                ),
            }
        if bar is not None:
            with counting:
                bar.update()
        return answer

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = [r for r in pool.map(one, range(requests)) if r is not None]
    seconds = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in done)
    return {
        "requests": len(done),
        "completion_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if done and seconds > 0 else 0.0,
        "mean_request_seconds": statistics.fmean(r["seconds"] for r in done) if done else None,
        "runs": done,
    }


def served_tidar_steps(log: Path, offset: int = 0) -> dict:
    """What the server's TiDAR generate() calls report in its log past `offset` bytes: calls,
    tokens, forwards."""
    with log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    found = [(int(a), int(b)) for a, b in TIDAR_LINE.findall(text)]
    tokens, forwards = sum(a for a, _ in found), sum(b for _, b in found)
    return {
        "calls": len(found),
        "new_tokens": tokens,
        "forwards": forwards,
        "tokens_per_forward": tokens / forwards if forwards else None,
    }


def bench_serve_cmd(
    model: str,
    clients: list[int] | None = None,
    requests: int = 8,
    max_tokens: int = 128,
    time_limit: float = 1800.0,
    startup_timeout: float = 300.0,
    device: str = "cpu",
    out: str | None = None,
    overwrite: bool = False,
) -> str:
    """Served tokens/s: an export under `transformers serve --trust-remote-code` on a loopback port,
    TiDAR against the same server with TiDAR off (per request, through its generation config), for
    each client count. Greedy chat prompts (bench.prompts.CHAT_PROMPTS) through the OpenAI API.

    Args:
        model: TiDAR export folder with a chat template (an Instruct base's).
        clients: concurrent client counts to measure (default [1, 4]).
        requests: requests per mode and client count (prompt i for request i).
        max_tokens: max_tokens of each request.
        time_limit: seconds for the whole run after the server is up; no request starts after it
            (the ones cut are missing from `requests` in the JSON).
        startup_timeout: seconds for the server to answer /health.
        device: the server's --device (cpu, cuda, auto).
        out: JSON path; default bench/results/<export name>-serve.json (the server's log beside it).
        overwrite: replace an earlier record at that path (refused before any work without it).

    Returns:
        Path of the JSON written.
    """
    from transformers import AutoTokenizer

    from tidar_convert.bench.machine import machine_info
    from tidar_convert.exports.folder import check_export

    clients = list(clients) if clients is not None else [1, 4]
    check_serve_args(clients, requests, max_tokens, time_limit, startup_timeout)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model={model!r} is not a folder; pass a TiDAR export folder (the OUT of "
            "`make convert`)."
        )
    check_export(path)
    json_path = Path(out) if out else Path("bench/results") / f"{path.resolve().name}-serve.json"
    from tidar_convert.exports.outputs import check_record_target

    check_record_target(json_path, overwrite, "pass --out with a new file")
    check_chat_template(AutoTokenizer.from_pretrained(path), str(path))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    log = json_path.with_suffix(".log")
    texts = [p["text"] for p in chat_prompts()]
    served = str(path.resolve())

    port = free_port()
    proc = start_server(path.resolve(), port, device, log, startup_timeout)
    try:
        # warm-up: the first request loads the remote code's kernels and timings
        for tidar in (True, False):
            chat_request(port, served, texts[0], min(max_tokens, 8), tidar, timeout=startup_timeout)
        offset = log.stat().st_size  # the warm-up's log lines are not the load's
        deadline = time.monotonic() + time_limit
        results = {}
        bar = Bar(total=len(clients) * len(MODES) * requests, desc="bench-serve", unit="request")
        for n in clients:
            by_mode = {}
            for mode in MODES:
                bar.set_description(f"bench-serve {mode}, {n} client(s)")
                by_mode[mode] = run_load(
                    port, served, texts, n, requests, max_tokens, mode == "tidar", deadline, bar
                )
            tidar, ar = by_mode["tidar"], by_mode["ar"]
            same = {r["prompt"]: r["text"] for r in ar["runs"]}
            results[str(n)] = {
                **by_mode,
                "tidar_vs_ar": tidar["tokens_per_s"] / ar["tokens_per_s"]
                if ar["tokens_per_s"] > 0
                else None,
                # greedy, so TiDAR's text is AR's: a served check of exactness
                "identical": sum(
                    r["text"] == same[r["prompt"]] for r in tidar["runs"] if r["prompt"] in same
                ),
            }
        cut = time.monotonic() > deadline
        bar.close()
    finally:
        stop_server(proc)
    import torch

    result = {
        "model": served,
        "server": (
            "transformers serve --trust-remote-code (sequential generate, no --continuous-batching)"
        ),
        "device": device,
        "prompt_set": "chat",
        "requests": requests,
        "max_tokens": max_tokens,
        "clients": clients,
        "time_limit": time_limit,
        "cut_by_time_limit": cut,
        "results": results,
        "served_tidar": served_tidar_steps(log, offset),
        "log": str(log),
        "machine": machine_info(torch.device(device if device != "auto" else "cpu")),
    }
    json_path.write_text(json.dumps(result, indent=1))
    for n, r in results.items():
        ratio = "-" if r["tidar_vs_ar"] is None else f"{r['tidar_vs_ar']:.2f}x"
        print(
            f"{n} client(s): TiDAR {r['tidar']['tokens_per_s']:.1f} tok/s, AR "
            f"{r['ar']['tokens_per_s']:.1f} tok/s ({ratio}); identical "
            f"{r['identical']}/{r['tidar']['requests']}",
            file=sys.stderr,
        )
    s = result["served_tidar"]
    if s["tokens_per_forward"] is not None:
        print(
            f"served TiDAR: {s['calls']} calls, {s['tokens_per_forward']:.2f} tokens per forward",
            file=sys.stderr,
        )
    if cut:
        print(
            f"bench-serve: the {time_limit:.0f} s limit cut the load; `requests` says how many ran",
            file=sys.stderr,
        )
    print(f"wrote {json_path}", file=sys.stderr)
    return str(json_path)
