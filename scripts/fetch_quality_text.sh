#!/bin/bash
# Fetch the English text the quality study (bench/quality/) measures perplexity on: the reStructuredText
# sources of the Python 3.11 documentation, from Debian's python3.11-doc package. Nothing is installed:
# `apt-get download` fetches the .deb and `dpkg-deb -x` unpacks it into an ignored cache folder.
#   bash scripts/fetch_quality_text.sh [CACHE_DIR]      (default: .cache/quality_text)
# The study pins the joined text by its SHA-256 (bench/quality/text.py), so a new Debian revision whose
# text differs is caught there, not here. A cached copy is kept only while it still joins to the pinned
# text; a damaged one (or another revision's) is fetched again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${1:-$ROOT/.cache/quality_text}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
PACKAGE=python3.11-doc
# The revision the pinned hash was taken from. Debian's mirror keeps only the newest revision of a
# release, so when this one is gone the current one is fetched and the hash check decides.
PINNED_VERSION=3.11.2-6+deb12u8
SUBDIRS=(tutorial howto faq reference)

if [ -f "$CACHE/SOURCE" ]; then
  if (cd "$ROOT" && "$PY" -c 'import sys; from bench.quality.text import load_text; load_text(sys.argv[1])' \
      "$CACHE") >/dev/null 2>&1; then
    echo "already there: $CACHE ($(cat "$CACHE/SOURCE"))"; exit 0
  fi
  echo "the text in $CACHE is not the pinned one (damaged, or not readable by $PY): fetching it again" >&2
fi
WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
if ! apt-get download "$PACKAGE=$PINNED_VERSION" >/dev/null 2>&1; then
  echo "note: $PACKAGE=$PINNED_VERSION is no longer on the mirror; fetching the current revision" >&2
  apt-get download "$PACKAGE" >/dev/null 2>&1 || { apt-get update -qq && apt-get download "$PACKAGE"; }
fi
DEB="$(ls "$WORK"/*.deb)"
VERSION="$(dpkg-deb -f "$DEB" Version)"
dpkg-deb -x "$DEB" "$WORK/x"
SRC="$WORK/x/usr/share/doc/python3.11/html/_sources"
mkdir -p "$CACHE.tmp"
for d in "${SUBDIRS[@]}"; do
  mkdir -p "$CACHE.tmp/$d"
  cp "$SRC/$d"/*.rst.txt "$CACHE.tmp/$d/"
done
echo "debian:$PACKAGE=$VERSION usr/share/doc/python3.11/html/_sources/{$(IFS=,; echo "${SUBDIRS[*]}")}/*.rst.txt" \
  > "$CACHE.tmp/SOURCE"
rm -rf "$CACHE"; mv "$CACHE.tmp" "$CACHE"
echo "fetched $(find "$CACHE" -name '*.rst.txt' | wc -l) files into $CACHE ($(cat "$CACHE/SOURCE"))"
