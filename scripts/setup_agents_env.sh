#!/usr/bin/env bash
# Build the separate Python environments in which grpokit's environment-library tests run (tests/agents_env,
# marker `agents_env`): `bash scripts/setup_agents_env.sh verifiers` or `... openenv`.
#
# Why separate environments, and why two: verifiers 0.4.0 pins openai<3 and mcp==2.0.0; openenv 0.10.0 needs
# fastmcp 3, which needs mcp<2; the main environment's openai-agents needs openai>=3. No one environment holds
# all three, so each library gets its own, outside the work tree (~/.cache/grpokit/venv-agents-<flavour>, the
# folder overridable with GRPOKIT_AGENTS_VENVS=dir) so that no clone commits it and every clone on this machine reuses it. Each holds
# torch (the CPU build, installed first so that nothing pulls a CUDA one), grpokit's dependencies at the versions
# of requirements/lock.txt, pytest, and the library at its pin from pyproject's extra of the same name; not
# grpokit itself: scripts/test_agents.sh puts the clone on PYTHONPATH.
# Idempotent: a ready environment is left as it is (rebuilt when pyproject.toml or the lock file changed).
set -euo pipefail
cd "$(dirname "$0")/.."
FLAVOUR="${1:?usage: setup_agents_env.sh verifiers|openenv}"
case "$FLAVOUR" in
    verifiers) PROBE="import verifiers.v1, pytest" ;;
    openenv) PROBE="import openenv.core.env_server, pytest" ;;
    *) echo "setup_agents_env: unknown flavour '$FLAVOUR'; use verifiers or openenv" >&2; exit 2 ;;
esac
VENV="${GRPOKIT_AGENTS_VENVS:-$HOME/.cache/grpokit}/venv-agents-$FLAVOUR"
PY="$VENV/bin/python"
MARK="$VENV/.grpokit-ready"
STAMP="$(cat pyproject.toml requirements/lock.txt | sha256sum | cut -c1-16)"

install_deps() {
    # torch is repeated so that nothing replaces the CPU build; the lock file pins what grpokit shares with the
    # library (transformers, pydantic, httpx, ...), less the pins these libraries set otherwise (the main
    # environment's openai 3 and mcp 2.3, for openai-agents; openenv's gradio wants pillow<13), and the extra
    # pins the library
    local constraints="$VENV/constraints.txt"
    grep -viE '^(openai|mcp|mcp-types|pillow)==' requirements/lock.txt > "$constraints"
    "$PY" -m pip install -q 'torch==2.13.0' -c "$constraints" -e ".[$FLAVOUR]" pytest pytest-timeout
    "$PY" -m pip uninstall -q -y grpokit
}

if [ -x "$PY" ] && [ -f "$MARK" ] && "$PY" -c "$PROBE" >/dev/null 2>&1; then
    if [ "$(cat "$MARK")" != "$STAMP" ]; then
        echo "setup_agents_env: updating $VENV"
        install_deps
        echo "$STAMP" > "$MARK"
    fi
    echo "setup_agents_env: $VENV is ready"
    exit 0
fi
mkdir -p "$(dirname "$VENV")"
python3 -m venv "$VENV"
"$PY" -m pip install -q 'torch==2.13.0'
install_deps
"$PY" -c "$PROBE"
echo "$STAMP" > "$MARK"
echo "setup_agents_env: $FLAVOUR ready in $VENV"
