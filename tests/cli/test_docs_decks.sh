#!/usr/bin/env bash
# docs/decks.md carries the generated key reference; fail if it is stale.
set -u
WLB=$1
SRC=$2
ref=$("$WLB" validate --reference) || { echo "FAIL: --reference"; exit 1; }
doc=$(cat "$SRC/docs/decks.md")
case "$doc" in
  *"$ref"*) echo "docs/decks.md is current" ;;
  *) echo "FAIL: docs/decks.md is stale; regenerate its Keys section with 'wlb validate --reference'"; exit 1 ;;
esac
