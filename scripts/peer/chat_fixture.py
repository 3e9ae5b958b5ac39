#!/usr/bin/env python3
"""What HF transformers makes of instruction data, for llora's tests: reads a JSON object
{"chats": [[{role, content}, ...], ...], "completions": [{prompt, completion}, ...]} on stdin
and prints {"chat_ids": [...], "prompt_ids": [...], "completion_ids": [...], "versions": {...}}:
  chat_ids        tokenizer.apply_chat_template(messages, tokenize=True) (the model's own
                  rendering, tokenised whole, no extra special tokens)
  ask_ids         the same with add_generation_prompt=True, for the conversations under
                  "asks" (what a model continues to answer)
  prompt_ids,
  completion_ids  tokenizer(text, add_special_tokens=False) of each part

Usage: chat_fixture.py TOKENIZER_DIR < input.json
"""
import json
import sys


def main():
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    data = json.load(sys.stdin)
    ids = lambda r: list(r["input_ids"] if not isinstance(r, list) else r)  # noqa: E731  (v5 returns a BatchEncoding)
    out = {
        "chat_ids": [ids(tok.apply_chat_template(m, tokenize=True)) for m in data.get("chats", [])],
        "ask_ids": [ids(tok.apply_chat_template(m, tokenize=True, add_generation_prompt=True))
                    for m in data.get("asks", [])],
        "prompt_ids": [tok(c["prompt"], add_special_tokens=False)["input_ids"] for c in data.get("completions", [])],
        "completion_ids": [tok(c["completion"], add_special_tokens=False)["input_ids"]
                           for c in data.get("completions", [])],
        "versions": {"transformers": transformers.__version__},
    }
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
