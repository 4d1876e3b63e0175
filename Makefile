# relpos: two commands do all the set-up on a fresh machine.
#   make test   create .venv if missing, check notebooks and library are in sync and clean, nbdev_test, pytest
#   make docs   create .venv if missing, export, build the rendered site into _docs/
# Override the torch requirement for other platforms, e.g. the CPU build on a stock Linux machine (whose PyPI wheel is
# the CUDA build); --index-url takes torch and its dependencies from that index only, so PyPI's CUDA wheel is never picked:
#   make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
ENV_STAMP := $(VENV)/.relpos-installed

.PHONY: env export check nbtest pytest test docs bench study memorizing-study smoke-oldest clean

# torch first: a bare `torch` requirement on a fresh venv would pull a multi-GB CUDA build.
$(ENV_STAMP): settings.ini setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[dev]"
	# labml_nn is a dev-only parity reference; its torchtext/torchvision pins break beside CPU torch
	$(BIN)/python -m pip install -q --no-deps labml-nn==0.5.1
	touch $@

env: $(ENV_STAMP)

export: env
	$(BIN)/nbdev_export

# notebooks are the source: exporting and cleaning a scratch copy must change nothing
check: env
	PATH=$(abspath $(BIN)):$$PATH bash tools/check_sync.sh

# Two test processes on two cores: one thread each. Tiny ops in an oversubscribed OpenMP pool wait for
# thread wake-ups (measured: a 400-step toy training took 1.3 s on 1 thread and 79 s on 2 under load).
# Benchmarks (make bench) keep torch's default.
TEST_ENV := OMP_NUM_THREADS=1

nbtest: env
	$(TEST_ENV) $(BIN)/nbdev_test --n_workers 2

pytest: env
	$(TEST_ENV) $(BIN)/python -m pytest -n 2 tests

test: check nbtest pytest

docs: export
	if command -v quarto >/dev/null; then $(BIN)/nbdev_docs; \
	else $(BIN)/python tools/render_docs.py && echo "rendered offline with nbconvert into _docs/ (quarto not found)"; fi

# make bench DEVICE=cuda: every case on the GPU (relpos.bench.bench_table reads RELPOS_BENCH_DEVICE)
DEVICE ?=
bench: env
	RELPOS_BENCH_DEVICE=$(DEVICE) $(BIN)/python -m bench

# The chapter "Which method?": train every position method and its variants (bench/study.py), each run stored as soon as
# it finishes in nbs/data/study/<phase>__<label>__seed<k>.json (resumable: rerun to continue), then execute the chapter
# and the docs home (and the guide that quotes it), whose tables and pictures are read from the stored runs. PHASE=main (60 runs, about an hour
# and a half on 2 cores), PHASE=long (4x the steps for every base method and the best variant of each family), PHASE=timing (CPU time of a step of
# every label: one thread, interleaved rounds, stored in nbs/data/study/cputime.json), PHASE=retrieval (bench/retrieval.py:
# passkey and associative recall read at 1x-16x, stored in nbs/data/retrieval/). DEVICE=cuda trains on a GPU.
STUDY_NB := nbs/11_which_method.ipynb
PHASE ?= main
STUDY_DEVICE := $(if $(DEVICE),--device $(DEVICE),)
study: env
	if [ "$(PHASE)" = retrieval ]; then OMP_NUM_THREADS=1 $(BIN)/python -m bench.retrieval $(STUDY_DEVICE); \
	else OMP_NUM_THREADS=1 $(BIN)/python -m bench.study --phase $(PHASE) $(STUDY_DEVICE); fi
	$(BIN)/python tools/execute_nb.py $(STUDY_NB) nbs/index.ipynb nbs/g3_which_method.ipynb && $(BIN)/nbdev_clean --fname $(STUDY_NB) && $(BIN)/nbdev_clean --fname nbs/index.ipynb && $(BIN)/nbdev_clean --fname nbs/g3_which_method.ipynb

# The Memorizing Transformer on long documents (bench/memorizing_study.py): every (phase, setting, seed) not yet stored
# in nbs/data/memorizing_study/ (resumable: rerun to continue), then the chapter that reports it. Two budgets: 'short'
# (20 runs, about 21 CPU-minutes of training) and 'long' (22 runs, about 100 CPU-minutes); one thread each, two at a
# time: the long budget took about an hour on two otherwise idle cores, several times that on a busy machine.
MEMSTUDY_NB := nbs/10_memorizing.ipynb
memorizing-study: env
	OMP_NUM_THREADS=1 $(BIN)/python -m bench.memorizing_study
	$(BIN)/python tools/execute_nb.py $(MEMSTUDY_NB) && $(BIN)/nbdev_clean --fname $(MEMSTUDY_NB)

# The oldest torch that settings.ini claims, in a venv of its own (outside `make test`: from PyPI this is a
# CUDA build of several GB). tools/smoke.py runs every module's fast and readable paths and compares them.
# Why 2.6: SDPA's enable_gqa (grouped-query heads) is 2.5's; FlexAttention's gradients for the tensors a score_mod
# reads (the T5 and FIRE tables on the CUDA route) are 2.6's. The smoke run is CPU only: it shows the first.
TORCH_OLDEST ?= torch==2.6.0
smoke-oldest:
	test -x .venv-oldest/bin/python || $(PYTHON) -m venv .venv-oldest
	.venv-oldest/bin/python -m pip install -q "$(TORCH_OLDEST)" numpy "fastcore>=1.5.29,<2"
	OMP_NUM_THREADS=1 PYTHONPATH=$(CURDIR) .venv-oldest/bin/python tools/smoke.py

clean:
	rm -rf _docs _proc .pytest_cache .hypothesis
