#!/usr/bin/env bash
# The chat end-to-end on CPU (configs/tiny-llama3-chat.toml): the demo's synthetic task as
# Llama-3-style conversations, a Llama-3-style tiny model (tied embeddings, llama3 RoPE)
# pre-trained then LoRA fine-tuned on them to the target, then `llora generate --chat` answers
# held-out conversations, each compared with its reference answer. Training packs whole
# conversations into 1024-token rows (`data.packing`; each attends only to itself).
#   ./scripts/demo-chat.sh                         # installs, builds, runs (~5 min on 2 cores)
#   ./scripts/demo-chat.sh --set run.threads=1     # extra arguments go to `llora train`
# LLORA=path/to/llora skips the install and build; OUT=dir puts data, base and run there
# (default runs/); ANSWERS=N held-out conversations are answered (default 4); THREADS=N
# intra-op threads for generate (default 0: one per core).
# Last line: one JSON object (status, eval_loss, answers, exact, words_right, words, min_prefix:
# the fewest leading words any answer has right). A reference answer is the report's topic's
# 24-word abstract, then the report's first 4 words: at the demo's target (eval loss 0.925)
# the model knows the abstracts, not yet the copying (measured: LoRA alone levels off at 0.69).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
if [[ -z "${LLORA:-}" ]]; then
  ./scripts/setup.sh
  cargo build --release --bin llora
  LLORA=$ROOT/target/release/llora
fi
OUT=${OUT:-runs}
ANSWERS=${ANSWERS:-4}
data=$OUT/demo-chat-data
base=$OUT/demo-llama3-base
# 1. The corpus as conversations with the Llama-3-style tokenizer (chat template included),
#    then tokenised through the template, labels on the assistant turns.
if [[ ! -f $data/tokenizer.json ]]; then
  "$LLORA" data synth --chat --out "$data" --train 2048 --eval 32 --vocab 512 --max-seq-len 252 --topics 8 --seed 0
fi
for split in train validation; do
  if [[ ! -f $data/$split.parquet ]]; then
    "$LLORA" data prepare --format chat --input "$data/$split.jsonl" --tokenizer "$data" \
      --out "$data/$split.parquet" --max-seq-len 256
  fi
done
# 2. Pre-training (first run only) and LoRA fine-tuning to the target.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$LLORA" train configs/tiny-llama3-chat.toml --set "model.path=$base" --set "data.train=$data/train.parquet" \
  --set "data.eval=$data/validation.parquet" --set "run.dir=$OUT/tiny-llama3-chat" "$@" | tee "$log"
summary=$(grep '^status: ' "$log" | tail -n 1)
run_dir=${summary##*run.dir: }
# 3. Held-out conversations answered greedily, each against its reference answer.
results=()
for k in $(seq 1 "$ANSWERS"); do
  row=$(sed -n "${k}p" "$data/validation.jsonl")
  python3 -c 'import json,sys; print(json.dumps(json.loads(sys.argv[1])["messages"][:-1]))' "$row" > "$log.chat"
  answer=$("$LLORA" generate --model "$base" --adapter "$run_dir/adapter" --tokenizer "$data" --chat "$log.chat" \
    --max-new-tokens 40 --threads "${THREADS:-0}" --json | tail -n 1)
  results+=("$(python3 -c '
import json, sys
ref = json.loads(sys.argv[1])["messages"][-1]["content"].split()
got = json.loads(sys.argv[2])["text"].split()
right = sum(a == b for a, b in zip(got, ref))
prefix = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
print(json.dumps({"reference": " ".join(ref), "answer": " ".join(got), "exact": got == ref, "words_right": right,
                  "prefix": prefix, "words": len(ref)}))
' "$row" "$answer")")
  rm -f "$log.chat"
done
python3 - "$summary" "${results[@]}" <<'PY'
import json, re, sys
summary, results = sys.argv[1], [json.loads(r) for r in sys.argv[2:]]
for k, r in enumerate(results):
    print(f"conversation {k}: {'exact' if r['exact'] else 'differs'} ({r['words_right']}/{r['words']} words right, "
          f"the first {r['prefix']} in a row)")
    print(f"  reference: {r['reference']}\n  answer:    {r['answer']}")
status = re.search(r"status: (\S+)", summary).group(1)
loss = re.search(r"eval_loss: (\S+)", summary).group(1)
print(json.dumps({"status": status, "eval_loss": None if loss == "n/a" else float(loss), "answers": len(results),
                  "exact": sum(r["exact"] for r in results), "words_right": sum(r["words_right"] for r in results),
                  "words": sum(r["words"] for r in results), "min_prefix": min(r["prefix"] for r in results)}))
sys.exit(0 if status == "success" else 1)
PY
