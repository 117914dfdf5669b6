# tidar-convert. `make convert` and `make test` each set up .venv on first use.
#   make convert [MODEL=hub-id|folder|file.gguf] [RECIPE=recipes/x.yaml] [OUT=folder] [MAX_STEPS=n] [RESUME=1]
#   make test | make test-fast | make lint | make bench MODEL=out/... [NAME=record] [OVERWRITE=1] [DRAFT_LENGTH=4] [DTYPE=bfloat16] [PROMPTS=chat] [SAMPLING=1] | make bench-serve MODEL=out/... [CLIENTS=[1,4]] | make bench-gpu | make lease-stage
#   make sweep SWEEP=recipes/sweeps/x.yaml RECIPE=recipes/y.yaml [MAX_STEPS=n] [VAL=n] [ARMS='[a, b]'] [SWEEP_OUT=folder]
#   make distill [MODEL=...] [DISTILL_OUT=runs/greedy.jsonl] [N_DOCS=n] [DTYPE=bfloat16]

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The torch build installed when the venv has none. Here pip finds the local CPU wheel for this pin;
# on a CUDA machine the same pin is PyPI's CUDA build. A torch already importable (say a CUDA
# build in the system site-packages, which the venv sees) is kept as it is.
TORCH ?= torch==2.13.0

RECIPE ?= recipes/smollm2-135m-cpu.yaml
MODEL ?=
OUT ?= out/$(basename $(notdir $(RECIPE)))
MAX_STEPS ?=
RESUME ?=
DRAFT_LENGTH ?=

SWEEP ?= recipes/sweeps/smollm2-cpu-levers.yaml
# The lever sweep varies issue 4's LoRA recipe: that is its base unless RECIPE is given.
SWEEP_RECIPE = $(if $(filter command line environment,$(origin RECIPE)),$(RECIPE),recipes/smollm2-135m-cpu-lora.yaml)
VAL ?=
ARMS ?=
SWEEP_OUT ?=
comma := ,

# Self-distillation corpus; its defaults are the data settings of recipes/smollm2-135m-cpu-best.yaml.
DISTILL_OUT ?= runs/greedy.jsonl
SOURCES ?= [prose-train, stdlib]
N_DOCS ?= 832
NEW_TOKENS ?= 160
VAL_EVERY ?= 50
DTYPE ?= float32

.PHONY: convert test test-fast lint bench bench-serve ppl bench-gpu lease-stage sweep distill clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install "$(TORCH)"
	$(BIN)/python -m pip install -e ".[dev,all]"
	touch $@

# A run folder that holds an earlier run: RESUME=1 continues it; otherwise this run goes beside it
# (<folder>-v2, ...), and nothing of the earlier one is lost. --overwrite replaces only an earlier
# export of this tool at OUT, never other files.
convert: $(BIN)/.installed
	$(BIN)/tidar-convert fit --config $(RECIPE) \
		$(if $(MODEL),--model.model $(MODEL)) \
		$(if $(MAX_STEPS),--trainer.max_steps $(MAX_STEPS)) \
		$(if $(RESUME),--ckpt_path last,--existing_run new) \
		--out $(OUT) --overwrite

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q --durations=15 tests

# What CI checks besides the tests: the formatter's output and the linter ([tool.ruff] in pyproject.toml).
lint: $(BIN)/.installed
	$(BIN)/python -m ruff format --check .
	$(BIN)/python -m ruff check .

test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m "not slow and not fit and not subprocess" tests

bench: $(BIN)/.installed
	$(BIN)/tidar-convert bench --model $(or $(MODEL),$(OUT)) $(if $(DRAFT_LENGTH),--draft-length $(DRAFT_LENGTH)) $(if $(LIMIT),--limit $(LIMIT)) $(if $(BASE),--base $(BASE)) $(if $(DTYPE),--dtype $(DTYPE)) $(if $(PROMPTS),--prompts $(PROMPTS)) $(if $(SAMPLING),--sampling) $(if $(NAME),--name $(NAME)) $(if $(OVERWRITE),--overwrite)

bench-serve: $(BIN)/.installed
	$(BIN)/tidar-convert bench-serve --model $(or $(MODEL),$(OUT)) $(if $(CLIENTS),--clients '$(CLIENTS)') $(if $(REQUESTS),--requests $(REQUESTS)) $(if $(OVERWRITE),--overwrite)

ppl: $(BIN)/.installed
	$(BIN)/tidar-convert eval-ppl --model $(or $(MODEL),$(OUT)) --data $(or $(DATA),prose)

bench-gpu: $(BIN)/.installed
	$(BIN)/tidar-convert bench-gpu

# What a GPU lease's two calls carry: .lease/1 and .lease/2 (docs/development.md, "A GPU lease").
lease-stage: $(BIN)/.installed
	$(BIN)/python -m tidar_convert.bench.lease_stage

# One `fit` per arm of SWEEP on RECIPE -> SWEEP_OUT (default runs/sweeps/<sweep name>)/sweep.json + sweep.png.
# Running it again skips finished arms and resumes an interrupted one.
sweep: $(BIN)/.installed
	$(BIN)/tidar-convert sweep --spec $(SWEEP) --recipe $(SWEEP_RECIPE) \
		$(if $(MAX_STEPS),--max_steps $(MAX_STEPS)) $(if $(VAL),--val_check_interval $(VAL)) \
		$(if $(ARMS),--arms '$(ARMS)') $(if $(SWEEP_OUT),--out $(SWEEP_OUT)) \
		$(if $(MODEL),--fit_args '[--model.model$(comma) $(MODEL)]')

# MODEL's greedy continuations of training prompts -> DISTILL_OUT; train on them with
# fit --data.greedy_corpus DISTILL_OUT (and the same --data.val_every). Replaces only an earlier corpus.
distill: $(BIN)/.installed
	$(BIN)/tidar-convert distill --out $(DISTILL_OUT) $(if $(MODEL),--model $(MODEL)) --sources '$(SOURCES)' \
		--n_docs $(N_DOCS) --new_tokens $(NEW_TOKENS) --val_every $(VAL_EVERY) --dtype $(DTYPE) --overwrite

clean:
	rm -rf runs wandb lightning_logs
