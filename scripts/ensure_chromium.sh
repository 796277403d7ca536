#!/usr/bin/env bash
# Makes sure Debian's chromium is installed (the status page's browser test drives it with Python playwright; the
# browser comes from apt, never from `playwright install`). Installs it with apt-get when missing.
# Exit status: 0 ready (prints the path), 77 cannot be had here (not root, or no apt-get), 1 the install failed.
set -euo pipefail
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
if [ -x "$CHROMIUM" ]; then echo "$CHROMIUM"; exit 0; fi
[ "$(id -u)" = 0 ] || { echo "chromium missing and not root: cannot install it" >&2; exit 77; }
command -v apt-get >/dev/null || { echo "chromium missing and no apt-get to install it" >&2; exit 77; }
# one apt at a time: the image test may be installing buildah (scripts/image_lib.sh); and it may have been installed
# while this waited
exec 9>/tmp/sentinel-apt.lock
flock 9
if [ -x "$CHROMIUM" ]; then echo "$CHROMIUM"; exit 0; fi
echo "installing chromium with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium >/dev/null
[ -x "$CHROMIUM" ] || { echo "apt-get installed chromium but $CHROMIUM is missing" >&2; exit 1; }
echo "$CHROMIUM"
