#!/usr/bin/env bash
# Fetches the charting library the trajectory viewer inlines (grpokit/viewer/static/, docs/viewer.md): uPlot, MIT,
# from the npm registry at a pinned version, checked against the registry's sha512 integrity before anything is
# unpacked. The three files it writes are committed as package data; rerun this only to change the version
# (then update VERSION and INTEGRITY from `npm view uplot@NEW dist.integrity`).
set -euo pipefail

VERSION=1.6.32
INTEGRITY="sha512-KIMVnG68zvu5XXUbC4LQEPnhwOxBuLyW1AHtpm6IKTXImkbLgkMy+jabjLgSLMasNuGGzQm/ep3tOkyTxpiQIw=="
DEST="$(cd "$(dirname "$0")/.." && pwd)/grpokit/viewer/static"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
curl -fsSL "https://registry.npmjs.org/uplot/-/uplot-${VERSION}.tgz" -o "$work/uplot.tgz"
got="sha512-$(openssl dgst -sha512 -binary "$work/uplot.tgz" | base64 -w0)"
if [ "$got" != "$INTEGRITY" ]; then
    echo "fetch_uplot: uplot-${VERSION}.tgz has integrity $got, expected $INTEGRITY; not installed" >&2
    exit 1
fi
tar -xzf "$work/uplot.tgz" -C "$work" package/dist/uPlot.iife.min.js package/dist/uPlot.min.css package/LICENSE
mkdir -p "$DEST"
cp "$work/package/dist/uPlot.iife.min.js" "$DEST/uPlot.iife.min.js"
cp "$work/package/dist/uPlot.min.css" "$DEST/uPlot.min.css"
cp "$work/package/LICENSE" "$DEST/uPlot.LICENSE"
echo "$VERSION" > "$DEST/uPlot.VERSION"
echo "fetch_uplot: uPlot $VERSION in $DEST"
