#!/usr/bin/env bash
# Installs Debian packages that are missing, through apt-get, non-interactively:
#   bash scripts/lib/apt-ensure.sh WHO PACKAGE...
# Returns at once when all are installed. As root (or with password-less sudo) it
# installs them; elsewhere it prints one line naming what is missing and exits 0, so the
# caller goes on and whatever needs the packages says so itself. A failing apt-get is an
# error. WHO prefixes every line (the calling script's name).
set -euo pipefail
who=$1
shift
missing=()
for p in "$@"; do
    status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    [[ "$status" == "install ok installed" ]] || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "$who: cannot install ${missing[*]}: apt-get not found; install them by hand" >&2
    exit 0
fi
sudo=()
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo=(sudo -n)
    else
        echo "$who: cannot install ${missing[*]}: not root and no password-less sudo" >&2
        exit 0
    fi
fi
echo "$who: installing ${missing[*]}" >&2
install() {
    # INITRD=No: a kernel package skips building the distribution's initrd (slow, unused).
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive INITRD=No \
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
# A fresh machine has empty package lists (apt-cache knows no candidate), and old lists
# may name versions the mirror no longer has: update first, or once after a failure.
updated=0
for p in "${missing[@]}"; do
    if ! apt-cache policy "$p" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
        "${sudo[@]}" apt-get update -qq
        updated=1
        break
    fi
done
if ! install; then
    [[ $updated -eq 0 ]] || exit 1
    "${sudo[@]}" apt-get update -qq
    install
fi
echo "$who: done" >&2
