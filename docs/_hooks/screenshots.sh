#!/usr/bin/env bash
# The docs site looked at in a real browser: build it (mkdocs --strict), serve it on localhost
# and take headless Chromium screenshots of the pages whose layout a test cannot read -- the
# front page's figure and caption, the configuration reference's table, a long code block --
# at a desktop and a narrow width, into OUT (default site_shots/). Needs Debian's chromium
# (apt-get install chromium) and the docs extra.
#   bash docs/_hooks/screenshots.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/../.."
out="$(realpath -m "${1:-site_shots}")"
site="$(mktemp -d)"
trap 'kill "${server:-0}" 2>/dev/null || true; rm -rf "$site"' EXIT
mkdocs build --strict --quiet -d "$site"
port=8765
python -m http.server "$port" --directory "$site" > /dev/null 2>&1 &
server=$!
sleep 1
mkdir -p "$out"
for page in index.html:front reference/configuration/index.html:configuration \
            guides/train/index.html:train; do
  for width in 1280 900; do
    name="${page##*:}-$width"
    chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
      --disable-background-networking --disable-component-update --disable-sync \
      --user-data-dir="$(mktemp -d)" --window-size="$width,1600" \
      --screenshot="$out/$name.png" "http://localhost:$port/${page%%:*}" > /dev/null 2>&1
    echo "$out/$name.png"
  done
done
