#!/usr/bin/env bash
# Render deploy/k8s/example.yaml (tests/unit/test_deploy.py checks it is up to date).
set -euo pipefail
cd "$(dirname "$0")/.."
uv run rl $(cat deploy/k8s/example.args) > deploy/k8s/example.yaml
