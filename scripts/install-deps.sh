#!/usr/bin/env bash
# Installs the Debian packages meshlm builds against, only those missing.
set -euo pipefail
need=()
for pkg in build-essential cmake pkg-config libopenmpi-dev openmpi-bin libopenblas-dev libjansson-dev libcmocka-dev libdnnl-dev libpcre2-dev libutf8proc-dev python3-numpy python3-pytest; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
[ ${#need[@]} -eq 0 ] && exit 0
echo "install-deps: installing ${need[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
