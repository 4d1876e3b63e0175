#!/usr/bin/env bash
# Notebooks are the source of relpos: exporting and cleaning a scratch copy of the working tree must
# leave the library, the notebooks and the README unchanged. Prints what differs and fails if anything does.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$root"
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$tmp"
cd "$tmp"
nbdev_export
nbdev_clean
python tools/render_docs.py --readme >/dev/null
fail=0
for p in relpos nbs README.md; do
  if ! diff -r -x __pycache__ -x '.ipynb_checkpoints' "$root/$p" "$tmp/$p" >"$tmp/diff.txt" 2>&1; then
    echo "out of sync: $p (run 'make export', 'nbdev_clean' and 'python tools/render_docs.py --readme', then commit)"
    head -40 "$tmp/diff.txt"; fail=1
  fi
done
[ $fail = 0 ] && echo "notebooks, library and README in sync; notebooks clean"
exit $fail
