#!/usr/bin/env bash
# Stage the Python packages a GPU run needs that the device image lacks, as wheels in .whl/
# (git-excluded), for scripts/gpu_check.sh to install with pip --no-index when present (the
# device machine reaches no registry). Today: GemLite, the INT4 kernels' comparison in
# bench/gpu_roofline.py. Run here, in the repository root, before the device call, and name
# `.whl` in the call's `carry`.
#
#   bash scripts/stage_gpu_wheels.sh
#
# gemlite 0.6.0.post2 is published as an sdist only: it is built here into a pure-Python wheel
# (py3-none-any). Its requirements (numpy, tqdm, triton>=3.6) are on the device image (Python
# 3.12, triton 3.6); any other one is downloaded as a manylinux cp312 wheel.
set -euo pipefail
PY="${PY:-python3}"
GEMLITE="${GEMLITE:-gemlite==0.6.0.post2}"
ON_DEVICE="numpy tqdm triton torch"  # what the device image already holds (of these deps)
WHL=.whl
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")" "$WHL"
grep -qxF "/$WHL/" "$exclude" 2>/dev/null || echo "/$WHL/" >>"$exclude"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --no-binary=:all: -d "$tmp" "$GEMLITE"
"$PY" -m pip wheel -q --no-deps -w "$WHL" "$tmp"/gemlite-*.tar.gz
wheel="$(ls "$WHL"/gemlite-*.whl | head -n 1)"
case "$wheel" in *-py3-none-any.whl) ;; *) echo "not a pure-Python wheel: $wheel" >&2 && exit 1 ;; esac

platforms=""
for n in 28 27 17; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
unzip -p "$wheel" '*/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' |
	while read -r req; do
		name="$(echo "$req" | sed 's/[ <>=!~;\[].*//' | tr 'A-Z_' 'a-z-')"
		case " $ON_DEVICE " in *" $name "*) continue ;; esac
		echo "staging $req"
		"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
			--implementation cp $platforms --platform manylinux2014_x86_64 -d "$WHL" "$req"
	done
ls -la "$WHL"
