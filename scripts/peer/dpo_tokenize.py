"""TRL 1.16's own tokenisation of preference rows (DPOTrainer._prepare_dataset, called as the
trainer calls it, without a model): prompt_ids, chosen_ids and rejected_ids of each row of a
jsonl file, with an HF tokenizer directory. What `llora data prepare --format preference` is
compared with (tests/it/cli.rs).

  .venv/bin/python scripts/peer/dpo_tokenize.py --tokenizer DIR --input rows.jsonl
"""
import argparse
import json
import tempfile
from types import SimpleNamespace


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--input", required=True)
    a = ap.parse_args()
    import transformers
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    transformers.logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    rows = [json.loads(line) for line in open(a.input) if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(output_dir=tmp, max_length=None, report_to=[], use_cpu=True, bf16=False)
        # The method reads only the trainer's tokenizer (for the EOS text) from `self`. A row at a
        # time: a dataset's column is text or messages, and the rows may mix them.
        out = [DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tok), Dataset.from_list([r]), tok, args, "train")[0]
               for r in rows]
    print(json.dumps([{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in out]))


if __name__ == "__main__":
    main()
