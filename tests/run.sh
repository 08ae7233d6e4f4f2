#!/usr/bin/env bash
# The whole test suite, from the repository root:
#   1. the Rust unit and property tests (cargo test --release),
#   2. a release build of the wheel (maturin), installed over any earlier one,
#   3. the Python tests (pytest tests -v); extra arguments go to pytest.
# Fails (non-zero) as soon as any step fails. GPU tests skip themselves, with
# a reason, where too few CUDA devices are visible.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo test --release

wheels="$(mktemp -d)"
trap 'rm -rf "$wheels"' EXIT
maturin build --release -o "$wheels"
python3 -m pip install --force-reinstall --no-deps "$wheels"/*.whl

python3 -m pytest tests -v "$@"
