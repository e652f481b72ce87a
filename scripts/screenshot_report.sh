#!/usr/bin/env bash
# Screenshot an HTML report the way a person sees it: headless Chromium, full page width, PNG.
#   scripts/screenshot_report.sh REPORT.html OUT.png [WIDTH] [HEIGHT]
# Needs the `chromium` Debian package (apt-get install -y chromium) or chromium-browser / google-chrome on PATH.
set -euo pipefail
html="$1"; out="$2"; width="${3:-1400}"; height="${4:-6000}"
browser=""
for b in chromium chromium-browser google-chrome google-chrome-stable; do
  if command -v "$b" >/dev/null 2>&1; then browser="$b"; break; fi
done
if [ -z "$browser" ]; then echo "no chromium on PATH (apt-get install -y chromium)" >&2; exit 3; fi
abs="$(cd "$(dirname "$html")" && pwd)/$(basename "$html")"
profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$profile" \
  --window-size="${width},${height}" --screenshot="$out" "file://$abs" >/dev/null 2>&1
test -s "$out"
echo "$out"
