"""Greedy tokens of every bench decoder that runs on an export, on the bench's 12 prompts, into a JSON file:
run it with two checkouts on PYTHONPATH and compare the files (bench/LOG.md, 2026-12-03: the one decode loop)."""

import json
import sys

import torch
from transformers import AutoTokenizer

from tidar_convert.bench.decoders import DECODERS
from tidar_convert.bench.prompts import bench_prompts
from tidar_convert.exports.folder import load

export, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = load(export).eval()
tok = AutoTokenizer.from_pretrained(export)
res = {}
with torch.inference_mode():
    for p in bench_prompts(12):
        ids = tok(p["text"], return_tensors="pt").input_ids
        for name, d in DECODERS.items():
            if d.weights != "export":
                continue
            kw = d.generate_kwargs(4, 10)
            got = model.generate(ids, max_new_tokens=n, do_sample=False, **kw)
            res[f"{p['id']}/{name}"] = got[0, ids.shape[1] :].tolist()
json.dump(res, open(out, "w"))
ar = {k.rsplit("/", 1)[0]: v for k, v in res.items() if k.endswith("/ar")}
print(len(res), "runs;", sum(v == ar[k.rsplit("/", 1)[0]] for k, v in res.items()), "equal to ar")
