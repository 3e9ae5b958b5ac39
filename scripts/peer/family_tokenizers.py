"""Qwen- and Mistral-style tokenizers for the family tests, made and run by HF's own libraries.

  family_tokenizers.py make OUT          train a byte-level BPE (Qwen 2's pre-tokenizer regex, byte-level
                                         alphabet, <|endoftext|> <|im_start|> <|im_end|>) of 1000 tokens on
                                         a mixed-script corpus; write OUT/tokenizer.json and
                                         OUT/tokenizer_config.json with Qwen 2's ChatML template
  family_tokenizers.py make-mistral OUT  train a SentencePiece-style BPE (spaces as "▁", one prepended to
                                         the first piece, as transformers 5 runs legacy = false ones;
                                         <unk> <s> </s> and [INST] [/INST] special, as v0.3's control tokens)
                                         of 1000 tokens; tokenizer_config.json with Mistral Instruct v0.2's
                                         template
  family_tokenizers.py encode DIR        stdin: a JSON list of strings; stdout: their ids (tokenizers)
  family_tokenizers.py chat DIR          stdin: a JSON list of conversations; stdout: each one's
                                         apply_chat_template ids (transformers)
  family_tokenizers.py retemplate DIR TEMPLATE OUT
                                         the tokenizer in DIR with another chat template, saved by
                                         transformers (which writes it to OUT/chat_template.jinja);
                                         TEMPLATE is a file, or trl:NAME for TRL's copy of a model's
                                         own template (trl/chat_templates/NAME)
  family_tokenizers.py chat-mask DIR     stdin: a JSON list of conversations; stdout: each one's
                                         {"ids", "mask"} from apply_chat_template with
                                         return_assistant_tokens_mask (or {"error"} where the
                                         template refuses it)
"""
import json
import sys
from pathlib import Path

# Qwen 2's pre-tokenizer split (its tokenizer.json), then byte-level without its own regex.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen 2 Instruct's chat template (ChatML with a default system turn).
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
MISTRAL_SPECIAL = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
# Mistral 7B Instruct v0.2's chat template (user and assistant turns alternating, no system turn).
MISTRAL_INST = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
                "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
                "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
                "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
                "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
                "roles are supported!') }}{% endif %}{% endfor %}")
CORPUS = [
    "The Government Accountability Office reported that federal agencies spent $4.2 billion in 2023.",
    "Die Regierung hat am 3. März über die Änderungen berichtet; Ärzte und Bürger waren dabei.",
    "Правительство опубликовало отчёт о расходах на инфраструктуру в 2022 году.",
    "政府问责局报告称，联邦机构在二零二三年花费了四十二亿美元。",
    "会計検査院は、連邦機関が支出を増やしたと報告した。",
    "الحكومة نشرت تقريرا عن الميزانية.",
    "Emoji 🙂🚀 and symbols: ≤ ≥ → ∑ — “quotes” ‘single’ … tabs\tand\nnew lines\r\n",
    "def f(x):\n    return x ** 2  # code with    spaces",
]


def make(out):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000 - len(SPECIAL), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_special_tokens(SPECIAL)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "Qwen2TokenizerFast", "chat_template": CHATML, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "bos_token": None, "add_bos_token": False, "model_max_length": 4096}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    print(json.dumps({"vocab": tok.get_vocab_size(), "specials": [tok.token_to_id(s) for s in SPECIAL]}))


def make_mistral(out):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    # The pipeline transformers 5 builds for a Llama-class tokenizer with legacy = false (it
    # rebuilds the file's own): "▁" prepended to the text's first piece only, so that the file
    # (as the tokenizers library runs it) and apply_chat_template agree.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    # Printable ASCII in the alphabet whatever the corpus holds (no byte fallback here).
    alphabet = [chr(c) for c in range(33, 127)]
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=MISTRAL_SPECIAL, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "LlamaTokenizerFast", "chat_template": MISTRAL_INST, "bos_token": "<s>",
              "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
              "legacy": False, "model_max_length": 4096}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    print(json.dumps({"vocab": tok.get_vocab_size(), "specials": [tok.token_to_id(s) for s in MISTRAL_SPECIAL]}))


def encode(path):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    print(json.dumps([e.ids for e in tok.encode_batch(json.load(sys.stdin), add_special_tokens=False)]))


def chat(path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in json.load(sys.stdin)]
    print(json.dumps(ids))


def retemplate(path, template, out):
    from transformers import AutoTokenizer
    if template.startswith("trl:"):
        import trl
        template = Path(trl.__file__).parent / "chat_templates" / template[len("trl:"):]
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = Path(template).read_text()
    tok.save_pretrained(out)
    print(json.dumps({"saved": [p.name for p in sorted(Path(out).iterdir())]}))


def chat_mask(path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    out = []
    for c in json.load(sys.stdin):
        try:
            # The mask needs the template's {% generation %} markup; without it, only the ids.
            marked = "generation %}" in tok.chat_template
            r = tok.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=marked)
            out.append({"ids": r["input_ids"], "mask": r["assistant_masks"] if marked else None})
        except Exception as e:  # the template's raise_exception (a refused conversation)
            out.append({"error": str(e)})
    print(json.dumps(out))


if __name__ == "__main__":
    commands = {"make": make, "make-mistral": make_mistral, "encode": encode, "chat": chat, "chat-mask": chat_mask,
                "retemplate": retemplate}
    if len(sys.argv) < 3 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    commands[sys.argv[1]](*sys.argv[2:])
