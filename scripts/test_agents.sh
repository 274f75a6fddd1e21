#!/usr/bin/env bash
# The environment-library tests (tests/agents_env, marker `agents_env`): the verifiers tests in the verifiers
# environment, the OpenEnv tests in the openenv one (scripts/setup_agents_env.sh builds each, first if missing;
# the two libraries cannot share one environment, see there). The main suite (`pytest -q`) needs neither.
# Extra arguments go to pytest, e.g. `bash scripts/test_agents.sh -k single_turn`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
rc=0
for flavour in verifiers openenv; do
    bash scripts/setup_agents_env.sh "$flavour"
    venv="${GRPOKIT_AGENTS_VENVS:-$HOME/.cache/grpokit}/venv-agents-$flavour"
    # exit 5 (nothing collected) is fine for one half when -k picks tests of the other only
    "$venv/bin/python" -m pytest -q -m "agents_env" -p no:cacheprovider "tests/agents_env/test_$flavour.py" "$@" \
        || { r=$?; [ "$r" -eq 5 ] && [ "$#" -gt 0 ] || rc=$r; }
done
exit "$rc"
