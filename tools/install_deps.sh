#!/usr/bin/env bash
# Installs the Debian packages diffgemma builds and tests with (idempotent; skips what is already installed).
# The CUDA toolkit is optional: with nvcc (e.g. /usr/local/cuda/bin/nvcc) the CUDA backend is built too.
set -euo pipefail
PACKAGES=(cmake g++ make pkg-config xz-utils liblzma-dev libfmt-dev nlohmann-json3-dev libcpp-httplib-dev
          libcli11-dev libgtest-dev libgmock-dev libbenchmark-dev python3 python3-jinja2 curl)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js runs the OpenAI-client server tests; a machine may already have it from elsewhere than Debian.
command -v node >/dev/null && command -v npm >/dev/null || missing+=(nodejs npm)
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
