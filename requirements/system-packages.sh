#!/usr/bin/env bash
# Debian packages the tests drive for real: redis-server (the Celery broker of tests/orchestration/test_celery.py), docker-registry
# and skopeo (the OCI store tests: a real registry and an independent client, tests/support/oci_registry.py) and
# chromium + chromium-driver (tests/orchestration/test_ui.py's headless browser). Installed when a command is missing;
# nothing is done when all are present. Without apt (or root) it says so in one line and goes on: the Celery
# test then fails naming redis-server, the browser test skips with its reason.
set -u
declare -A PACKAGE=([redis-server]=redis-server [chromium]=chromium [chromedriver]=chromium-driver [docker-registry]=docker-registry [skopeo]=skopeo)
missing=()
for cmd in "${!PACKAGE[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${PACKAGE[$cmd]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; else
    echo "system-packages: not root and no sudo: install ${missing[*]} yourself (apt-get install ${missing[*]})"; exit 0
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "system-packages: no apt-get here: install ${missing[*]} yourself"; exit 0
fi
echo "== installing ${missing[*]} (Debian packages)"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >/tmp/hive-aot-apt.log 2>&1 \
  || { $sudo apt-get update -q >>/tmp/hive-aot-apt.log 2>&1 && \
       $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" >>/tmp/hive-aot-apt.log 2>&1; } \
  || echo "system-packages: apt-get could not install ${missing[*]} (log: /tmp/hive-aot-apt.log)"
exit 0
