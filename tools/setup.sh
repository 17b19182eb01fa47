#!/usr/bin/env bash
# Installs dependencies, builds, and runs the main job on the bundled default model (tests/fixtures/tiny-v: a tiny
# random DiffusionGemma with the real 262144-token Gemma 4 vocabulary, so its text is meaningless but real).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install_deps.sh
tools/build.sh
./build/diffgemma info -m tests/fixtures/tiny-v
./build/diffgemma generate -m tests/fixtures/tiny-v --prompt "Write a haiku about the sea." --max-new-tokens 64 \
  --seed 7 --backend cpu
