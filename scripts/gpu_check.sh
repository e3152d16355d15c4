#!/usr/bin/env bash
# Everything that needs a GPU, as one run of a lent GPU's short time (docs/performance.md,
# "On a GPU"): the GPU tests (W8A8 FP8 GEMM included), the engine benchmark (CUDA graphs vs
# eager, INT4 / FP8 weights, FP8 KV), the kernels benchmark (its model_gemm rows: W8A8 vs
# W8A16 vs BF16, which set fp8_activations=auto's rule) and, when named, the INT4 GEMV
# sweep (`sweep`) and the W8A8 GEMM's prefill tile sweep (`fp8_sweep`). Each stage has its own
# time limit and writes to $OUT as it goes, so a stage cut short leaves the others' results.
#
#   OUT=/tmp/gpu bash scripts/gpu_check.sh            # python3 = a python with torch + triton
#   STAGES="tests sweep" T_SWEEP=150 OUT=/tmp/gpu bash scripts/gpu_check.sh
#   STAGES=roofline OUT=/tmp/gpu bash scripts/gpu_check.sh   # issue 35's table, < 8 minutes
#
# `roofline`: the INT4 sweep and the W8A8 sweep (each writes its tuned table for this GPU into
# slimserve_kernels/configs/), then bench/gpu_roofline.py (our kernels, with those tables,
# beside cuBLAS BF16, GemLite and the BF16-cache attention kernel; L2 flushed per call); the
# tables are copied to $OUT/tables (into the archive) to be checked in.
# Wheels in .whl/ (scripts/stage_gpu_wheels.sh: gemlite and what it needs) are installed into
# /tmp/site first when present, as the device README describes.
#
# $OUT ends with the stages' logs and results-HHMMSS.tgz (a lent machine returns <= 8 files).
# Run `fp8_sweep` in a call of
# its own, after the others: its first try (2026-12-05, an H100) ended with the machine no
# longer answering and nothing returned (cause unknown: the sweep's launches or the machine).
set -u
OUT="${OUT:-/tmp/slimserve-gpu}"
PY="${PY:-python3}"
STAGES="${STAGES:-tests gpu_engine kernels}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
	"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
		--target /tmp/site .whl/*.whl >"$OUT/wheels.log" 2>&1 &&
		export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The C++ CPU kernels are not what a GPU run checks, and their first build (tests/conftest.py
# builds all three at session start) would take minutes of the lent time: the CPU sides of the
# GPU-vs-CPU tests take the torch path.
export SLIMSERVE_CPU_KERNELS="${SLIMSERVE_CPU_KERNELS:-0}"

stage() {  # stage NAME SECONDS CMD...: run CMD under a time limit, log to $OUT/NAME.log
	local name=$1 limit=$2
	shift 2
	case " $STAGES " in *" $name "*) ;; *) return ;; esac
	echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/$name.log"
	local t0=$SECONDS
	timeout --signal=INT --kill-after=10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
	echo "== $name: rc=$? in $((SECONDS - t0))s" | tee -a "$OUT/$name.log"
}

{
	date -u
	nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
	"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} >"$OUT/env.log" 2>&1

stage tests "${T_TESTS:-200}" "$PY" -m pytest -q -p no:cacheprovider -rfEs \
	tests/kernels/test_kernels_gpu.py tests/engine/test_cuda_graphs_gpu.py tests/engine/test_engine_gpu.py
stage gpu_engine "${T_ENGINE:-150}" "$PY" bench/gpu_engine.py --quick --out "$OUT" ${ENGINE_ARGS:-}
stage kernels "${T_KERNELS:-170}" "$PY" bench/kernels.py --quick --out "$OUT"
stage sweep "${T_SWEEP:-150}" "$PY" bench/int4_gemv_sweep.py --out "$OUT"
stage fp8_sweep "${T_FP8_SWEEP:-300}" "$PY" bench/fp8_gemm_sweep.py --out "$OUT"
roofline() {  # the sweeps (tables into slimserve_kernels/configs), then the comparison
	local lim="timeout --signal=INT --kill-after=10"
	$lim "${T_INT4_SWEEP:-150}" "$PY" bench/int4_gemv_sweep.py --out "$OUT"
	echo "int4 sweep rc=$?"
	$lim "${T_FP8_SWEEP:-150}" "$PY" bench/fp8_gemm_sweep.py --out "$OUT"
	echo "fp8 sweep rc=$?"
	$lim "${T_COMPARE:-150}" "$PY" bench/gpu_roofline.py --out "$OUT"
	echo "comparison rc=$?"
	mkdir -p "$OUT/tables" && cp -r slimserve_kernels/configs/. "$OUT/tables/"
}
stage roofline "${T_ROOFLINE:-470}" bash -c "$(declare -f roofline); PY=$PY OUT=$OUT roofline"
# A lent machine returns at most 8 files: the logs stay as they are, the rest (JSON, PNG) go
# into one archive per run of this script (unpack with `tar xzf results-*.tgz`).
others=$(cd "$OUT" && ls | grep -v -e '\.log$' -e '^results-.*\.tgz$')
if [ -n "$others" ]; then
	(cd "$OUT" && tar czf "results-$(date -u +%H%M%S).tgz" $others && rm -rf $others)
fi
tail -n 3 "$OUT"/*.log
