# Two commands: `make serve` runs the main job (the OpenAI endpoint on 127.0.0.1:8000), `make test`
# runs the tests.
# Each creates .venv and installs what it needs on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; GPU users: `make test TORCH_SPEC='torch>=2.13'` (any newer CUDA build).
TORCH_SPEC ?= torch==2.13.0
# the built-in model trained on Python source; "tiny" is the random one, or give a checkpoint directory
MODEL ?= tiny-code
PROMPT ?= def fibonacci(n):
BIN := $(VENV)/bin
STAMP := $(VENV)/.rackserve-installed

.PHONY: install test test-fast serve generate clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Everything except the tests marked slow, for quick local iterations.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

serve: $(STAMP)
	$(BIN)/rackserve serve --model $(MODEL) $(if $(CONFIG),--config $(CONFIG))

generate: $(STAMP)
	$(BIN)/rackserve generate --model $(MODEL) "$(PROMPT)"

clean:
	rm -rf $(VENV) .pytest_cache
