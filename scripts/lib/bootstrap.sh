# Sourced by scripts/*.sh: a project virtualenv with neonvm installed, on PATH.
# Re-installs only when pyproject.toml or setup.cfg changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${NEONVM_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating virtualenv $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.neonvm-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/setup.cfg" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "==> installing neonvm and its test dependencies into $VENV" >&2
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT[test]"
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
