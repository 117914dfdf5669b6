"""Measurements: TiDAR against AR and prompt-lookup decoding, forward latency vs query slots,
perplexity.

`tidar-convert bench --model OUT` decodes a fixed held-out prompt set (prompts.py: HumanEval prompts
interleaved with a few plain-text ones, or with --prompts chat 24 chat instructions through the
model's chat template; --sampling also samples) with every decoder of the table in decoders.py,
batch 1, greedy, on the same weights:

  ar                  transformers' own generate (tidar=False)
  prompt_lookup       transformers' prompt-lookup decoding (n-gram drafts from the prompt)
  tidar               TiDAR decoding with its defaults (hybrid drafts, cost plan; one forward a
                      step)
  tidar_adaptive      the same drafts on the adaptive plan (verified whenever likely, whatever a
                      step costs)
  tidar_diffusion     TiDAR with diffusion drafts only (adaptive plan: the drafter's own
                      acceptance)
  tidar_lookup        TiDAR with lookup drafts only, on the cost plan
  base_prompt_lookup  prompt lookup on the base model the export was converted from (recorded in
                      the export; `--base` to name another): what a user gets without converting

The modules, one concern each:
  prompts.py     the prompt set
  decoders.py    the table of decoders, one counted and timed generation
  summary.py     totals per decoder, ratios to AR and to prompt lookup, the printed lines
  slots.py       forward latency against query slots, and where each decoder's step sits on it
  steps.py       a TiDAR step's time split by the engine's phases (torch.profiler)
  plots.py       the PNGs
  machine.py     what it ran on
  timing.py      wall-clock timing, synchronized on a GPU
  perplexity.py  `tidar-convert eval-ppl`: AR perplexity (a TiDAR model must keep its base's)
  cli.py         `tidar-convert bench`, and the generation-quality guard on its outputs (quality.py)
  serve.py       `tidar-convert bench-serve`: tokens/s as served by `transformers serve`, TiDAR vs
                 TiDAR off
  quality.py     `tidar-convert quality`: the generation-quality guard
  sweep*.py      `tidar-convert sweep`: one recipe, several arms, a learning curve per arm

Beside the bench, each writing one JSON record (bench/README.md):
  gpu.py             `tidar-convert bench-gpu`: slots, steps, training and the engine on a CUDA
                     device (engine_check.py: generate() there); also `python -m` where
                     jsonargparse is missing (plain_cli.py: the same flags, from the signature)
  without.py         runs a module with packages hidden: the CPU rehearsal of a GPU lease
  batches.py         `tidar-convert bench-batches`: TiDAR against AR at batch 1, 4, 16
  exactness.py       `tidar-convert bench-exactness`: every decoder's logits against AR's, bit for
                     bit
  recurrent.py       `tidar-convert bench-recurrent`: what recurrent layers cost under TiDAR
  token_identity.py  `tidar-convert bench-token-identity`: every decoder's tokens, to compare two
                     checkouts
"""
