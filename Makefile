PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-long lint serve bench bench-peer protos clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=20 -m "not long"

# Headless Chromium and Prometheus, Debian's packages, for tests/ops/test_dashboard.py (the
# Ray dashboard in a browser) and `slimserve serve --metrics`; installed (as root) if missing.
.PHONY: test-deps
test: test-deps
test-deps:
	@command -v chromium >/dev/null && command -v prometheus >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium prometheus; }

# The full fuzz, soak and load runs (docs/reliability.md); not part of CI.
test-long: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=20 -m long

serve: $(STAMP)
	$(BIN)/slimserve serve

bench: $(STAMP)
	$(BIN)/python bench/kv_capacity.py
	$(BIN)/python bench/throughput.py

# slimserve vs vLLM's CPU build, offline and served (docs/performance.md); not part of
# `make test`. The peer's venv (.venv-vllm) is built on demand by scripts/peer_venv.sh.
bench-peer: $(STAMP)
	bash scripts/peer_venv.sh
	$(BIN)/python bench/vs_vllm.py
	$(BIN)/python bench/serve_vs_vllm.py

# gRPC code: protos/ -> app/serve/grpc_api/grpc_gen/ (checked in; tests/grpc fails if it drifts).
protos: $(STAMP)
	$(BIN)/python app/serve/grpc_api/grpc_codegen.py .

clean:
	rm -rf $(VENV)
