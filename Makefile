# tidar-convert. `make convert` and `make test` each set up .venv on first use.
#   make convert [MODEL=hub-id|folder|file.gguf] [RECIPE=recipes/x.yaml] [OUT=folder] [MAX_STEPS=n]
#   make test | make test-fast | make bench MODEL=out/... [K=4] | make bench-gpu

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
K ?=

.PHONY: convert test test-fast bench ppl bench-gpu clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install "$(TORCH)"
	$(BIN)/python -m pip install -e ".[dev,eval]"
	touch $@

convert: $(BIN)/.installed
	$(BIN)/tidar-convert fit --config $(RECIPE) \
		$(if $(MODEL),--model.model $(MODEL)) \
		$(if $(MAX_STEPS),--trainer.max_steps $(MAX_STEPS)) \
		--out $(OUT) --overwrite  # replaces only an earlier export of this tool, never other files

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q tests

test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m "not slow" tests

bench: $(BIN)/.installed
	$(BIN)/tidar-convert bench --model $(or $(MODEL),$(OUT)) $(if $(K),--k $(K)) $(if $(LIMIT),--limit $(LIMIT)) $(if $(BASE),--base $(BASE))

ppl: $(BIN)/.installed
	$(BIN)/tidar-convert eval-ppl --model $(or $(MODEL),$(OUT)) --data $(or $(DATA),prose)

bench-gpu: $(BIN)/.installed
	$(BIN)/python -m tidar_convert.bench_gpu

clean:
	rm -rf runs wandb lightning_logs
