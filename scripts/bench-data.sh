#!/usr/bin/env bash
# Loader throughput at 8192 tokens: a synthetic GovReport-shaped set (long reports, a realistic
# spread of lengths) written as MLPerf parquet, then sequences/s and tokens/s of the training
# batch stream with 0, 1, 2 and 4 prefetch workers and of one evaluation pass with 1 and 4 eval
# workers. Compare tokens/s with what the trainer consumes (metrics.jsonl tokens_per_s; the
# tiny CPU demo runs ~2-3k tokens/s).
# Then `llora data prepare`'s tokenisation with the Llama 2 and the Llama 3 tokenizer
# (scripts/llama2-tokenizer.sh, scripts/llama3-tokenizer.sh; need node and npm) on a generated
# GovReport-sized text corpus: documents/s and tokens/s.
#   ./scripts/bench-data.sh            # 1024 train rows, 173 eval rows; 17,000 reports of 9,000 words
#   DOCS=2000 ./scripts/bench-data.sh  # a smaller text corpus (the full one takes ~5-10 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >&2
cargo build --release --quiet --bin llora
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
./target/release/llora data synth --out "$dir" --train "${TRAIN:-1024}" --eval 173 --max-seq-len 8192 --vocab 32000 >/dev/null
./target/release/llora data bench --train "$dir/train.parquet" --eval "$dir/validation.parquet" --steps "${STEPS:-200}"
./scripts/llama2-tokenizer.sh "$dir/llama2" >&2
./target/release/llora data bench-tokenizer --tokenizer "$dir/llama2/tokenizer.json" --docs "${DOCS:-17000}" --words 9000
./scripts/llama3-tokenizer.sh "$dir/llama3" >&2
./target/release/llora data bench-tokenizer --tokenizer "$dir/llama3/tokenizer.json" --docs "${DOCS:-17000}" --words 9000
