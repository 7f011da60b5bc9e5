#!/usr/bin/env bash
# Re-pin requirements/constraints.txt to what requirements/install.sh installed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
{
  echo "# The pinned stack (pip freeze of the environment requirements/install.sh builds). Regenerate with"
  echo "# requirements/lock.sh after changing pyproject.toml's requirements."
  "$root/.venv/bin/pip" freeze --exclude-editable | grep -v '^rlhf-operator'
} > "$root/requirements/constraints.txt.new"
mv "$root/requirements/constraints.txt.new" "$root/requirements/constraints.txt"
