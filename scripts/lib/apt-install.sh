# shellcheck shell=bash
# apt_install STEP CONSEQUENCE PACKAGE...: install the missing PACKAGEs with apt-get.
# Idempotent. When it cannot (not root, not Debian, apt fails) it prints why, with
# CONSEQUENCE (which tests will skip), and still returns 0: the suite then skips those
# tests with a visible reason instead of failing.
apt_install() {
  local step=$1 consequence=$2
  shift 2
  local packages=("$@") missing=() p
  if [ "$(id -u)" -ne 0 ]; then
    echo "$step: not root, not installing ${packages[*]} ($consequence)"
    return 0
  fi
  if ! command -v apt-get >/dev/null || [ ! -r /etc/debian_version ]; then
    echo "$step: not a Debian system with apt-get, not installing ${packages[*]} ($consequence)"
    return 0
  fi
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    echo "$step: ${packages[*]} already installed"
    return 0
  fi
  echo "$step: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || { echo "$step: apt-get update failed ($consequence)"; return 0; }
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || { echo "$step: apt-get install failed ($consequence)"; return 0; }
  echo "$step: installed"
}
