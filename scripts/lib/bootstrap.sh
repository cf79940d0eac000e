# Sourced by scripts/*.sh: a project virtualenv with neonvm installed, on PATH.
# Re-installs only when pyproject.toml or setup.cfg changed since the last install, or
# when an optional dependency group is wanted that was not installed.
# NEONVM_EXTRAS: the groups to install, comma-separated ("test" unless set). The demo
# sets it empty: it needs no pytest, mypy or ruff, so a first run does not fetch them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${NEONVM_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
extras="${NEONVM_EXTRAS-test}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating virtualenv $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.neonvm-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/setup.cfg" | sha256sum | cut -d' ' -f1)"
# The stamp is "<hash> <extras>"; a stamp of a hash alone is from before extras were
# recorded, when "test" was always installed.
have="$(cat "$stamp" 2>/dev/null || true)"
have_extras="test"
[[ "$have" != *" "* ]] || have_extras="${have#* }"
current=1
[ "${have%% *}" = "$want" ] || current=0
for e in ${extras//,/ }; do
  [[ ",$have_extras," == *",$e,"* ]] || current=0
done
if [ "$current" = 0 ]; then
  echo "==> installing neonvm${extras:+ and its ${extras} dependencies} into $VENV" >&2
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # The install is editable, through setuptools' meta path finder (our flat layout): only
  # `neonvm` becomes importable, never `tests`, so the entry point cannot lean on test
  # code. setuptools prints a ten-line "Editable installation." notice about exactly that
  # (information, not an error); it is filtered here so a first run shows no false alarm.
  PYTHONWARNINGS="ignore:Editable installation" \
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT${extras:+[$extras]}"
  echo "$want $extras" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
