# `make demo` and `make test` work on a fresh machine: each builds .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint unit venv clean screenshots docs

venv: $(STAMP)

# torch goes in first and alone: pip takes 2.13.0 from the machine's local CPU wheel, and
# nothing installed after it can then pull a multi-GB CUDA build. tensorflow-cpu is the Keras
# tests' second backend (KERAS_BACKEND=tensorflow), not a dependency of preemptible.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,torch,lightning,mlflow,wandb,postgres,bayes,plot,transformers,keras,jax,cloud,docs]' tensorflow-cpu
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/preemptible demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

# with-services.sh starts a single-node SLURM (installing it with apt if needed) for the
# tests that need it and stops it afterwards; where it cannot, those tests skip and say why.
# The unit tier runs on both cores (pytest-xdist: 1 min instead of several). The integration
# tier runs in three lanes, each one test at a time (tests/services/lanes.sh): the tests that
# mostly wait on a clock (SLURM's time limit, leases; marked `waits`), the frameworks' fits
# (marked `frameworks`) and all the others; a lane keeps about one core busy.
# Both tiers run, and either failing fails the target. The docs site is built first (strict):
# the browser test of tests/integration/test_docs_site.py opens what it built.
test: lint docs
	bash tests/services/with-services.sh sh -c '"$$0" -m pytest -n 2 tests/unit; u=$$?; bash tests/services/lanes.sh "$$0" tests/integration && exit $$u' $(BIN)/python

unit: $(STAMP)
	$(BIN)/python -m pytest -n 2 tests/unit

# The docs site (mkdocs.yml) into site/, strict: a warning, a broken link or a missing reference
# fails. Its CLI and API references are generated from click and the docstrings; its code
# blocks are run by tests/integration/test_readme.py.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The pictures of the web page on docs/sweeps.md (docs/status-page.png, docs/status-run-page.png): the
# demo's test takes them in headless chromium (Debian's: apt-get install -y chromium).
screenshots: $(STAMP)
	PREEMPTIBLE_SCREENSHOTS=docs $(BIN)/python -m pytest -q tests/integration/test_sweep_demo.py -k serves_its_page

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
