#!/usr/bin/env bash
# Loads every SVG in a folder in headless Chromium (Debian package `chromium`) and fails if
# one does not render: Chromium's DOM of a broken SVG is an XHTML page with a <parsererror>,
# of a good one the <svg> element itself. With --png DIR it also screenshots each SVG to
# DIR/<name>.png (to look at). Not part of CI (Chromium is a large install).
#
#   tools/eval/check_svgs.sh out/svg [--png out/png]
set -euo pipefail
dir=${1:?usage: check_svgs.sh DIR [--png OUTDIR]}
png=""
if [[ ${2:-} == --png ]]; then png=${3:?--png needs a folder}; mkdir -p "$png"; fi
browser=$(command -v chromium || command -v chromium-browser || true)
[[ -n $browser ]] || { echo "check_svgs: chromium not found (apt-get install chromium)" >&2; exit 2; }
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
flags=(--headless --no-sandbox --disable-gpu --user-data-dir="$profile" --hide-scrollbars)
shopt -s nullglob
files=("$dir"/*.svg)
(( ${#files[@]} > 0 )) || { echo "check_svgs: no .svg in $dir" >&2; exit 1; }
failed=0
for f in "${files[@]}"; do
  url="file://$(realpath "$f")"
  dom=$(timeout 60 "$browser" "${flags[@]}" --dump-dom "$url" 2>/dev/null || true)
  if [[ $dom != "<svg"* ]] || grep -q parsererror <<<"$dom"; then
    echo "FAIL $f: does not render"
    grep -o 'error on line[^<]*' <<<"$dom" | head -1 || true
    failed=1
    continue
  fi
  if [[ -n $png ]]; then
    w=$(grep -o 'width="[0-9.]*"' "$f" | head -1 | tr -dc '0-9.')
    h=$(grep -o 'height="[0-9.]*"' "$f" | head -1 | tr -dc '0-9.')
    out="$png/$(basename "${f%.svg}").png"
    timeout 60 "$browser" "${flags[@]}" --window-size="${w%.*},${h%.*}" --screenshot="$out" "$url" >/dev/null 2>&1 || true
    [[ -s $out ]] || { echo "FAIL $f: no screenshot"; failed=1; continue; }
  fi
  echo "ok   $f"
done
exit $failed
