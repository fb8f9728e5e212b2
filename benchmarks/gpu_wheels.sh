#!/usr/bin/env bash
# Builds .whl/: the Python packages the GPU machine lacks, as wheels for its Python 3.12 on x86-64 Linux.
#
#   bash benchmarks/gpu_wheels.sh          # from anywhere; writes <repo>/.whl (ignored by git)
#
# The GPU machine has torch, triton, transformers, peft, pytest and xdist but no network, so what the
# GPU agenda (benchmarks/gpu_agenda.sh) needs beyond its image travels with the working tree (the device
# tool's `carry: [".whl"]`) and is installed there with `pip install --no-index --no-deps --target`.
# Pins: torchao and omegaconf as pyproject's extras and the trainer use them, liger-kernel for the fused
# linear-CE, torchtitan with what its model code imports (benchmarks/titan_sides.py's TORCHTITAN and
# TORCHTITAN_IMPORTS). antlr4-python3-runtime (omegaconf's parser) has only an sdist on PyPI, so it is
# built here (pure Python). triton is never sent: the machine's own matches its torch, and a second
# copy on the path would shadow it.
#
# The folder is rebuilt from scratch each time (two versions of one package would stop the install).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_WHEELS_DIR:-.whl}
PY=${PYTHON:-python3}
PINS=(torchao==0.18.0 torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0
  liger-kernel==0.8.5 omegaconf==2.3.0)
BUILT=antlr4-python3-runtime==4.9.3

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$tmp" "${PINS[@]}"
"$PY" -m pip wheel -q --no-deps "$BUILT" -w "$tmp"

# Checks: one wheel per pin, each for CPython 3.12 / abi3 / pure Python on x86-64, and no triton.
want=$((${#PINS[@]} + 1))
got=$(find "$tmp" -maxdepth 1 -name '*.whl' | wc -l)
if [ "$got" -ne "$want" ]; then
  echo "gpu_wheels: expected $want wheels, got $got:" >&2
  ls "$tmp" >&2
  exit 1
fi
for whl in "$tmp"/*.whl; do
  name=$(basename "$whl")
  case $name in
    triton-*) echo "gpu_wheels: triton must not travel ($name)" >&2; exit 1 ;;
    *-py3-none-any.whl | *-cp312-*manylinux*x86_64*.whl | *-abi3-*manylinux*x86_64*.whl) ;;
    *) echo "gpu_wheels: $name is not for CPython 3.12 on x86-64 Linux" >&2; exit 1 ;;
  esac
done
rm -rf "$DEST"
mkdir -p "$DEST"
mv "$tmp"/*.whl "$DEST"/
ls -1 "$DEST"
echo "gpu_wheels: $got wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
