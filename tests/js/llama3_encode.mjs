// The npm package llama3-tokenizer-js's own encoder, for tests/tokenizer.rs: reads a JSON array
// of strings on stdin, prints a JSON array of their token ids (no <|begin_of_text|>, no eos), with
// every string plain text: text that spells a special token is encoded as its characters.
//   node tests/js/llama3_encode.mjs PATH/TO/llama3-tokenizer-with-baked-data.js < strings.json
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const tok = (await import(pathToFileURL(process.argv[2]).href)).default;
const strings = JSON.parse(readFileSync(0, "utf8"));
// A regex that matches nothing: no substring is taken for a special token.
const plain = { bos: false, eos: false, specialTokenRegex: /(?!)/g };
process.stdout.write(JSON.stringify(strings.map((s) => tok.encode(s, plain))));
