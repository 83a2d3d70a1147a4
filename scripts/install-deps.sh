#!/usr/bin/env bash
# make deps: the dependencies of cmake/deps.txt that are missing — none: says
# so and exits 0 on any system; some, on Debian/Ubuntu: installs their
# packages (apt-get, sudo when not root); elsewhere: names them with the
# RHEL/Fedora packages and exits 1. --build-only skips what only the tests
# need (cmocka, numpy, pytest); --mpich adds MPICH (`make test-mpich`).
# Nothing else is touched.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
want="build tests"
case "${1:-}" in
  --build-only) want=build ;;
  --mpich) want="build tests mpich" ;;
esac

# present HOW: whether the check "pkg:M", "header:H", "cmd:C" or "py:M" passes
present() {
  local kind=${1%%:*} what=${1#*:}
  case $kind in
    pkg) pkg-config --exists "$what" 2>/dev/null ;;
    cmd) command -v "$what" > /dev/null ;;
    py) for py in python3 /usr/bin/python3; do # the tests take the first that has both
          "$py" -c "import $what" 2> /dev/null && return 0
        done
        return 1 ;;
    header) local cpath=${CPATH:-} d
            for d in /usr/include /usr/local/include ${cpath//:/ }; do
              [ -f "$d/$what" ] && return 0
            done
            return 1 ;;
  esac
}

# trim S: S without its leading and trailing blanks
trim() {
  local s=$1
  s=${s#"${s%%[![:space:]]*}"}
  printf '%s' "${s%"${s##*[![:space:]]}"}"
}

missing=() deb=() rhel=()
while IFS='|' read -r name how d r use; do
  name=$(trim "$name") how=$(trim "$how") use=$(trim "$use")
  case " $want " in *" $use "*) ;; *) continue ;; esac
  present "$how" && continue
  missing+=("$name")
  deb+=($d)
  rhel+=($r)
done < <(grep -v '^#' "$here/cmake/deps.txt")

if [ ${#missing[@]} -eq 0 ]; then
  echo "deps: everything meshlm needs is present"
  exit 0
fi
if ! command -v apt-get > /dev/null; then
  echo "deps: missing ${missing[*]}; this is not a Debian system: install them (RHEL/Fedora:" \
       "dnf install ${rhel[*]}) and run make again" >&2
  exit 1
fi
echo "deps: missing ${missing[*]}; installing ${deb[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${deb[@]}"
