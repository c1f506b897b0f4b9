# blockdiag — every target creates .venv when missing and installs the project with its test, bench, hf and trainer extras.
# torch is pinned to 2.13.0: its CPU build lies on this machine's disk; an unpinned torch pulls a CUDA build.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
JOBS   ?= 2

EXAMPLES ?= 200
SEED   ?= 0
LONG_EXAMPLES ?= 40
LONG_BUDGET   ?= 600

.PHONY: install peers test test-slow verify verify-models models-md models-catalogue fuzz fuzz-long bench bench-quick train-demo conformance gpu-check

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[test,bench,hf,trainer]" --config-settings editable_mode=compat
	@touch $@

install: $(STAMP)

# Third-party CP implementations the conformance report judges (verify/adapters), pinned, without their full
# dependency trees: nemo-automodel's blockdiag_cp needs torch only; ring-attention-pytorch needs einops,
# beartype and jaxtyping (which needs wadler-lindig); axolotl-ringmaster needs torch and transformers (its optional
# flash-linear-attention kernels are not installed: the report quotes its refusal). ring-flash-attn is CUDA only
# (it imports flash_attn).
PEERS := nemo-automodel==0.7.0 ring-attention-pytorch==0.5.20 einops==0.8.2 beartype==0.23.1 \
         jaxtyping==0.3.11 wadler-lindig==0.1.8 axolotl-ringmaster==0.2.7
PEERS_STAMP := $(VENV)/.peers-installed

$(PEERS_STAMP): $(STAMP) Makefile
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(PEERS)
	@touch $@

peers: $(PEERS_STAMP)

# pytest exits 5 when it collects no tests; make treats that like any failure.
# One intra-op thread per process: $(JOBS) test processes (and their pools' ranks) already fill the cores, and the
# tests' tensors are tiny; extra OpenMP threads only spin against the other processes.
test: $(STAMP) $(PEERS_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(JOBS) --timeout=300 -q

# The tests marked slow (over make test's budget; `make test` skips them, naming why): torch.compile through the Trainer.
test-slow: $(STAMP)
	OMP_NUM_THREADS=1 BLOCKDIAG_SLOW_TESTS=1 $(PY) -m pytest -n 0 --timeout=900 -q -m slow

# The main job: the case matrix (CP 1, 2, 3, 4, 8; every layout, exchange, kernel) against the reference.
verify: $(STAMP)
	$(PY) -m verify $(ARGS)

# Generated reports go under results/ (ignored by git), so these targets leave the clone clean. Name a tracked page
# to rewrite it: make verify-models MODELS_MD=MODELS.md; make models-catalogue CATALOGUE_MD=docs/models.md.
MODELS_MD    ?= results/MODELS.md
CATALOGUE_MD ?= results/models.md

# Whole models: every preset (tiny Llama, Qwen3, Mistral, Gemma 3, Qwen3-MoE, DeepSeek-V3, Qwen3-Next, Nemotron-H,
# Qwen2.5-VL, Qwen3-VL, Gemma 3 with images, PaliGemma, gpt-oss, Llama 4, Gemma 2, BLOOM, DeepSeek-V3.2, GLM-5, Jamba, Falcon-Mamba, Mamba, Kimi Linear, Ling, MiniMax) at CP 1 and 2, four layouts, float64 and float32, against
# each document run alone (docs/verify-model.md): $(MODELS_MD) and results/models.json. A refusal is reported, not failed.
verify-models: $(STAMP)
	$(PY) -m verify model --presets --cp 1,2 --allow-unsupported --md $(MODELS_MD) --json results/models.json $(ARGS)

models-md: verify-models

# The whole catalogue: every causal-LM and image-text-to-text model type of the installed transformers, tiny, float64,
# one packed row at CP 1 and 2, each classed pass / refused / wrong / cannot build / cannot run / crash / hang
# (verify/model/catalogue.py): $(CATALOGUE_MD) (the generated part of an existing page, or a new page) and
# results/catalogue.json. Exit 1 only when a model is wrong (a silent failure), crashed or hung. About 10-30
# minutes on 2 busy cores.
models-catalogue: $(STAMP)
	$(PY) -m verify model --catalogue --cp 1,2 --md $(CATALOGUE_MD) --json results/catalogue.json $(ARGS)

# Hypothesis-drawn cases; a failure is shrunk and printed as a replay command.
fuzz: $(STAMP)
	$(PY) -m verify fuzz --examples $(EXAMPLES) --seed $(SEED) $(ARGS)

# Long rows (documents up to 1,100 tokens: every varlen size class and the exact path), within a time budget.
fuzz-long: $(STAMP)
	$(PY) -m verify fuzz --long --examples $(LONG_EXAMPLES) --budget $(LONG_BUDGET) --seed $(SEED) $(ARGS)

# Performance figures as side-by-side ratios: results/bench.json, results/bench.png, BENCHMARKS.md. Installs the
# peers (make peers) first; a peer that still fails to import is named in the output and its column left empty.
bench: $(STAMP) $(PEERS_STAMP)
	$(PY) -m bench --write-md

bench-quick: $(STAMP) $(PEERS_STAMP)
	$(PY) -m bench --quick

# A few steps of the tiny decoder at CP 1 and CP 2 (CPU, gloo); the last line is the loss parity, exit 1 if it fails.
train-demo: $(STAMP)
	$(PY) -m examples.demo --cp 2

# Every implementation (ours and the third parties in verify/adapters) x layout x doc-id source x CP x dtype,
# each case classed pass / contract / unsupported / bug / crash / hang; then axolotl-ringmaster's state passing and
# the Trainers section (one step at CP 2 through our trainers, accelerate's CP and TRL, against each document alone):
# CONFORMANCE.md and results/conformance.json.
conformance: $(PEERS_STAMP)
	$(PY) -m verify conformance --trainers --ringmaster-state --md CONFORMANCE.md --json results/conformance.json $(ARGS)

# The GPU check (docs/gpu.md): report.json and summary.txt in $(OUT), under 8 minutes. No install: on a
# GPU machine it runs the working tree on that machine's python3 (torch, numpy); here the venv's python if any.
OUT ?= results/gpu
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	PYTHONPATH=. $(GPU_PYTHON) -m verify gpu --out $(OUT) $(ARGS)
