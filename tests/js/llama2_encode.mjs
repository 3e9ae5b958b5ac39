// The npm package llama-tokenizer-js's own encoder, for tests/tokenizer.rs: reads a JSON array
// of strings on stdin, prints a JSON array of their token ids (no <s>, "▁" prepended).
//   node tests/js/llama2_encode.mjs PATH/TO/llama-tokenizer.js < strings.json
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const tok = (await import(pathToFileURL(process.argv[2]).href)).default;
const strings = JSON.parse(readFileSync(0, "utf8"));
// Encoded with <s> and the <s> dropped: without it the package skips a merge of the first
// priority at position 0 (its priority plus position is 0, which it reads as "no merge").
const ids = strings.map((s) => (s.length === 0 ? [] : tok.encode(s, true, true).slice(1)));
process.stdout.write(JSON.stringify(ids));
