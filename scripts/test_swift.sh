#!/usr/bin/env bash
# The tests against ms-swift's own code (tests/swift_env, marker `swift_env`) in the environment that
# scripts/setup_swift_env.sh builds (made first if missing). The main suite (`pytest -q`) never needs ms-swift.
# Extra arguments go to pytest, e.g. `bash scripts/test_swift.sh -k weights`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SWIFT_VENV:-$HOME/.cache/grpokit/venv-ms-swift-4.6.0}"
bash scripts/setup_swift_env.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest -q -m "swift_env" -p no:cacheprovider tests/swift_env "$@"
