// Generates the tokenizer exactness fixture: a deterministic corpus of >= 20k strings and the ids / decode output
// that the real Hugging Face `tokenizers` library (Rust crate 0.22.2, via @anush008/tokenizers 0.6.0) produces.
//
//   cd tools/text && npm install && node make_tokenizer_fixtures.mjs \
//       [TOKENIZER_JSON_OR_XZ] [OUT_DIR]
//
// Defaults: ../../tests/fixtures/tokenizer/tokenizer.json.xz -> ../../tests/fixtures/tokenizer/.
// Writes OUT_DIR/corpus.jsonl.xz, one JSON object per line:
//   {"text": s, "ids": [...]}                       encode(s, add_special_tokens=false)
//     + "ids_bos": [...]                            on some lines: encode(s, add_special_tokens=true)
//     + "plain_ids": [...]                          when different from ids: encoding with no added-token
//                                                   matching (special-token text treated as plain text)
//     + "decoded": "..."                            when decode(ids, false) != s
//     + "decoded_skip": "..."                       when decode(ids, true) != decoded
//   {"decode_ids": [...], "decoded": "...", "decoded_skip": "..."}   decode-only cases (random ids, byte runs)
// The first line is a header with the generator settings.
import { createRequire } from 'node:module';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const require = createRequire(import.meta.url);
const { Tokenizer } = require('@anush008/tokenizers');

const here = path.dirname(fileURLToPath(import.meta.url));
const tokenizerPath = process.argv[2] ?? path.join(here, '../../tests/fixtures/tokenizer/tokenizer.json.xz');
const outDir = process.argv[3] ?? path.join(here, '../../tests/fixtures/tokenizer');
const SEED = 20250406;

function readTokenizerJson(p) {
  if (p.endsWith('.xz')) return execFileSync('xz', ['-dc', p], { maxBuffer: 1 << 30 }).toString('utf8');
  return fs.readFileSync(p, 'utf8');
}

// ---- deterministic PRNG (mulberry32) ----
let state = SEED >>> 0;
function rand() {
  state = (state + 0x6d2b79f5) >>> 0;
  let t = state;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const randInt = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1)); // inclusive
const pick = (arr) => arr[Math.floor(rand() * arr.length)];
const chance = (p) => rand() < p;

// ---- source material ----
const SENTENCES = [
  'Write a long essay about Portugal.', 'The quick brown fox jumps over the lazy dog.',
  "Hello, world! How's it going?", 'It is sunny.', 'I should call the tool',
  'Der schnelle braune Fuchs springt über den faulen Hund. Größe, Maße, Straße.',
  "L'été dernier, nous sommes allés à la plage près de Cannes; c'était très agréable.",
  'El niño comió piñas y jalapeños en la montaña. ¿Dónde está la biblioteca? ¡Olé!',
  'Não há nada como o pão quente de manhã, coração e ação.',
  'Съешь же ещё этих мягких французских булок, да выпей чаю.',
  'Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.', 'Pchnąć w tę łódź jeża lub ośm skrzyń fig.',
  'Şişli’de çalışan öğretmen güzel çiçekler aldı.', 'Příliš žluťoučký kůň úpěl ďábelské ódy.',
  'Tiếng Việt có dấu: Tôi yêu đất nước tôi, ngọc ngà.', 'Jag älskar smörgåsbord och blåbär.',
  '我能吞下玻璃而不伤身体。今天天气很好，我们去公园散步吧！', '敏捷的棕色狐狸跳过了懒狗。',
  'いろはにほへと ちりぬるを わかよたれそ つねならむ。東京は日本の首都です。', 'カタカナとひらがなと漢字',
  '다람쥐 헌 쳇바퀴에 타고파. 안녕하세요, 만나서 반갑습니다.',
  'أنا قادر على أكل الزجاج و هذا لا يؤلمني. مرحبا بالعالم',
  'זה כיף סתם לשמוע איך תנצח קרפד עץ טוב בגן.', 'मैं काँच खा सकता हूँ और मुझे उससे कोई चोट नहीं पहुंचती।',
  'আমি কাঁচ খেতে পারি, তাতে আমার কোনো ক্ষতি হয় না।', 'நான் கண்ணாடி சாப்பிடுவேன், அதனால் எனக்கு ஒரு கேடும் வராது.',
  'ฉันกินกระจกได้ แต่มันไม่ทำให้ฉันเจ็บ', 'ሰማይ አይታረስ ንጉሥ አይከሰስ።', 'მინას ვჭამ და არა მტკივა.',
  'Կրնամ ապակի ուտել և ինծի անհանգիստ չըներ։', 'ខ្ញុំអាចញុំកញ្ចក់បាន ដោយគ្មានបញ្ហា', 'ຂອ້ຍກິນແກ້ວໄດ້ໂດຍທີ່ມັນບໍ່ໄດ້ເຮັດໃຫ້ຂອ້ຍເຈັບ.',
  'Mogę jeść szkło i mi nie szkodzi.', 'Ég get etið gler án þess að meiða mig.', 'Aš galiu valgyti stiklą.',
  'Mi povas manĝi vitron, ĝi ne damaĝas min.', 'ᐊᓕᒍᖅ ᓂᕆᔭᕌᖓᒃᑯ ᓱᕋᙱᑦᑐᓐᓇᖅᑐᖓ', '𝔗𝔥𝔢 𝕢𝕦𝕚𝕔𝕜 𝓫𝓻𝓸𝔀𝓷 ｆｏｘ',
  'Ｆｕｌｌ－ｗｉｄｔｈ　ｔｅｘｔ　１２３', 'e\u0301 a\u0300 n\u0303 o\u0308 (combining marks)', 'ﬁ ﬂ ﬃ ligatures, ½ ¾ ™ © ®',
  'Mathematics: ∀x∈ℝ, ∃y: x² + y² ≥ 0; ∫₀^∞ e^{-x} dx = 1; √2 ≈ 1.41421356',
  'Prices: $1,234.56 — €99,99 — £5 — ¥1000 — ₹250 — ₿0.001', 'Dates: 2024-03-15T12:34:56Z, 15/03/2024, March 15th',
  'Phone +1 (555) 123-4567; email test.user+tag@example.co.uk; https://example.com/path?q=1&r=2#frag',
];
const CODE = [
  'def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n',
  'int main(int argc, char** argv) {\n\tstd::vector<int> v{1, 2, 3};\n\tfor (auto& x : v) x *= 2;\n\treturn 0;\n}\n',
  'const f = async (x) => { await fetch(`/api/${x}`); return x ?? null; };',
  '{"name": "diffgemma", "version": "0.1.0", "tags": ["a", "b"], "nested": {"k": [1, 2.5, -3e10, true, null]}}',
  '<html>\n  <body>\n    <table><tr><td>cell</td></tr></table>\n  </body>\n</html>',
  'SELECT id, name FROM users WHERE age >= 18 AND name LIKE \'%son\' ORDER BY id DESC LIMIT 10;',
  'fn main() {\n    let s: &str = "hi";\n    println!("{s:?} {}", s.len());\n}',
  '#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do echo "$f" | tr a-z A-Z; done 2>&1 >/dev/null',
  'return x  # tabs', '    x = 1', 'a  b', 'if (a&&b||!c) { x <<= 2; y >>= 3; z ^= ~w; }',
  '\\begin{equation} E = mc^2 \\end{equation} % LaTeX', 'regex: ^(?:[a-z0-9!#$%&\'*+/=?^_`{|}~-]+)$',
  '| col1 | col2 |\n|------|------|\n| a    | b    |\n', '- [ ] todo\n- [x] done\n> quote\n```python\nprint(1)\n```',
];
const EMOJI = [
  '😀', '👍🏽', '👨‍👩‍👧‍👦', '🏳️‍🌈', '🇵🇹', '🇯🇵', '1️⃣', '#️⃣', '❤️', '🧑🏿‍🚀', '👩‍❤️‍💋‍👨', '🐈‍⬛', '🫠', '🦀',
  '☃', '✈️', '🙇‍♀️', '🏴󠁧󠁢󠁳󠁣󠁴󠁿', '😶‍🌫️', '🤷🏻‍♂️', '🧔‍♀️', '💁🏾', '🫱🏼‍🫲🏿',
];
const SPECIAL_TEXT = [
  '<pad>', '<eos>', '<bos>', '<unk>', '<mask>', '<|tool>', '<tool|>', '<|tool_call>', '<tool_call|>',
  '<|tool_response>', '<tool_response|>', '<|"|>', '<|think|>', '<|channel>', '<channel|>', '<|turn>', '<turn|>',
  '<|image>', '<|audio>', '<|image|>', '<|audio|>', '<image|>', '<audio|>', '<|video|>',
  // near misses, overlaps and Gemma 3 names that are plain text in Gemma 4
  '<|turn', 'turn|>', '<|tur>', '<<|turn>>', '<|turn><turn|>', '<|tool_call|>', '<|tool><|tool_call>', '<eos',
  '<start_of_turn>', '<end_of_turn>', '<unused5>', '<unused6241>', '<table>', '</table>', '<0x41>', '<0xFF><0xFE>',
  '<|"|>value<|"|>', 'call:get_weather{location:<|"|>Tokyo<|"|>}', '<|image|><|image|><|image|>', '<|', '|>', '<>',
];
const WHITESPACE = [' ', '  ', '\n', '\n\n', '\t', '\r\n', '\r', '\u00a0', '\u3000', '\u200b', '\u2028', '\u2029',
  '\u000b', '\u000c', '\u0085', '\u2009', '\u202f', '\ufeff', ' \n', '\n ', '\t\n', ' \t '];
const INVALID_LOOKING = ['\ufffd', '\ufffd\ufffd', '\\xff\\xfe', '\\u00e9', '%C3%A9', 'Ã©', 'â€™', 'Ã¼ber', '\u00c3\u00a9',
  '&amp;&lt;&#x1F600;', '\uffff', '\ufffe', '\u{10ffff}', '\u{e0001}', '\u{f0000}', '\u{1fffe}', '\u0000', '\u001b[31m'];

const ALL_FRAGMENTS = [...SENTENCES, ...CODE, ...EMOJI, ...SPECIAL_TEXT, ...WHITESPACE, ...INVALID_LOOKING];

function randomCodePoint() {
  const r = rand();
  let cp;
  if (r < 0.2) cp = randInt(0x20, 0x7e);
  else if (r < 0.3) cp = randInt(0x00, 0xff);
  else if (r < 0.55) cp = randInt(0x100, 0xffff);
  else if (r < 0.7) cp = randInt(0x4e00, 0x9fff);
  else if (r < 0.8) cp = randInt(0x1f300, 0x1faff);
  else if (r < 0.9) cp = randInt(0x10000, 0x10ffff);
  else if (r < 0.95) cp = randInt(0xe000, 0xf8ff);
  else cp = pick([0xfffd, 0xfffe, 0xffff, 0xfeff, 0x200d, 0xfe0f, 0x0301, 0x2581, 0x2028, 0x7f, 0x85, 0xad]);
  if (cp >= 0xd800 && cp <= 0xdfff) cp = 0xfffd; // lone surrogates cannot cross into Rust as UTF-8
  return String.fromCodePoint(cp);
}
const randomCodePoints = (n) => Array.from({ length: n }, randomCodePoint).join('');

function whitespaceRun() {
  const ch = pick([' ', '\n', '\t', ' ', '\n', '\r\n', '\u00a0', ' \n']);
  return ch.repeat(pick([1, 2, 3, 15, 30, 31, 32, 33, 40, 62, 63, 64, 65, 100, randInt(1, 140)]));
}

function controlChars(n) {
  let s = '';
  for (let i = 0; i < n; i++) s += String.fromCodePoint(chance(0.7) ? randInt(0, 0x1f) : randInt(0x7f, 0x9f));
  return s;
}

function mutate(s) {
  const cps = Array.from(s);
  const edits = randInt(1, 4);
  for (let e = 0; e < edits; e++) {
    const pos = randInt(0, cps.length);
    const op = rand();
    if (op < 0.4) cps.splice(pos, 0, randomCodePoint());
    else if (op < 0.6 && cps.length) cps.splice(Math.min(pos, cps.length - 1), 1);
    else if (op < 0.8) cps.splice(pos, 0, pick(WHITESPACE));
    else cps.splice(pos, 0, pick(SPECIAL_TEXT));
  }
  return cps.join('');
}

function mixed() {
  const parts = [];
  const n = randInt(1, 6);
  for (let i = 0; i < n; i++) {
    parts.push(pick([pick(SENTENCES), pick(CODE), pick(EMOJI), pick(SPECIAL_TEXT), pick(INVALID_LOOKING),
                     randomCodePoints(randInt(1, 8)), String(randInt(0, 1e9)), whitespaceRun()]));
    parts.push(pick(['', ' ', ' ', '\n', '  ', '\t', '\n\n', '']));
  }
  return parts.join('');
}

const GENERATORS = [
  [0.12, () => pick(SENTENCES)],
  [0.05, () => pick(CODE)],
  [0.22, mixed],
  [0.08, () => mutate(pick(ALL_FRAGMENTS))],
  [0.08, () => Array.from({ length: randInt(1, 5) }, () => pick(EMOJI)).join(pick(['', ' ', '\u200d', '\ufe0f']))],
  [0.08, () => randomCodePoints(randInt(1, 40))],
  [0.08, () => `${pick(['', 'x', 'word'])}${whitespaceRun()}${pick(['', 'y', 'z', '# c', '\n'])}${whitespaceRun()}`],
  [0.05, () => `${pick(SENTENCES)}${controlChars(randInt(1, 6))}${pick(SENTENCES)}`],
  [0.10, () => { const cps = Array.from(pick(SENTENCES)); const at = randInt(0, cps.length);
                 return cps.slice(0, at).join('') + pick(SPECIAL_TEXT) + cps.slice(at).join('') +
                        (chance(0.5) ? pick(SPECIAL_TEXT) : ''); }],
  [0.05, () => Array.from({ length: randInt(2, 12) }, () => pick(SPECIAL_TEXT)).join(pick(['', '', ' ', '\n']))],
  [0.04, () => pick(INVALID_LOOKING).repeat(randInt(1, 4)) + pick(SENTENCES)],
  [0.05, () => String(rand() * 10 ** randInt(0, 12)) + pick([' ', ', ', '\n']) + String(randInt(-1e6, 1e6))],
];

function generateCorpus(count) {
  const corpus = ['', ' ', '  ', '\n', '\t', '\r\n', 'a', 'A', '▁', '▁▁', ' ▁ ', '\u0000', '\ufffd'];
  for (let c = 0; c < 128; c++) corpus.push(String.fromCharCode(c));
  corpus.push(...SENTENCES, ...CODE, ...EMOJI, ...SPECIAL_TEXT, ...INVALID_LOOKING);
  for (const n of [30, 31, 32, 33, 40, 64, 100, 257]) {
    corpus.push(' '.repeat(n), '\n'.repeat(n), '\t'.repeat(n), 'x' + '\n'.repeat(n) + 'y', ' '.repeat(n) + 'z');
  }
  for (let i = 0; i < 60; i++) { // long strings: long BPE words and many merges
    corpus.push(Array.from({ length: randInt(20, 150) }, () => (chance(0.8) ? mixed() : pick(CODE))).join(''));
  }
  const total = GENERATORS.reduce((a, [w]) => a + w, 0);
  while (corpus.length < count) {
    let r = rand() * total;
    for (const [w, gen] of GENERATORS) {
      if ((r -= w) <= 0) { corpus.push(gen()); break; }
    }
  }
  // A lone UTF-16 surrogate would reach Rust as U+FFFD while the fixture stored something else.
  for (const s of corpus) if (!s.isWellFormed()) throw new Error(`generator produced a lone surrogate: ${JSON.stringify(s)}`);
  return corpus;
}

function byteToken(b) { return 238 + b; }

function generateDecodeCases(count, vocabSize, specialIds) {
  const cases = [];
  const utf8Of = (s) => Array.from(Buffer.from(s, 'utf8'));
  for (let i = 0; i < count; i++) {
    const ids = [];
    const n = randInt(1, 16);
    for (let k = 0; k < n; k++) {
      const r = rand();
      if (r < 0.25) ids.push(randInt(0, vocabSize - 1));
      else if (r < 0.45) for (let j = randInt(1, 6); j > 0; j--) ids.push(byteToken(randInt(0, 255)));
      else if (r < 0.65) { // a valid character spelled as bytes, sometimes truncated
        const bytes = utf8Of(randomCodePoint());
        const keep = chance(0.3) ? randInt(0, bytes.length) : bytes.length;
        for (const b of bytes.slice(0, keep)) ids.push(byteToken(b));
      } else if (r < 0.8) ids.push(pick(specialIds));
      else if (r < 0.9) ids.push(pick([236743, 138, 107, 108, 255968, 9259, 236764, 2364, 4368, 4])); // ▁, runs, words
      else ids.push(randInt(0, 600)); // dense region: specials, unused, byte tokens
    }
    cases.push(ids);
  }
  return cases;
}

async function main() {
  const jsonText = readTokenizerJson(tokenizerPath);
  const tok = Tokenizer.fromString(jsonText);
  const parsed = JSON.parse(jsonText);
  const specialIds = parsed.added_tokens.map((a) => a.id);
  // The oracle for parse_special=false: the same tokenizer without added-token matching.
  const plainTok = Tokenizer.fromString(JSON.stringify({ ...parsed, added_tokens: [] }));
  const vocabSize = tok.getVocabSize(true);

  const corpus = generateCorpus(20500);
  const decodeCases = generateDecodeCases(4000, vocabSize, specialIds);

  const lines = [JSON.stringify({
    generator: 'tools/text/make_tokenizer_fixtures.mjs', seed: SEED, oracle: '@anush008/tokenizers 0.6.0 (tokenizers 0.22.2)',
    strings: corpus.length, decode_cases: decodeCases.length, vocab_size: vocabSize,
  })];
  for (let i = 0; i < corpus.length; i++) {
    const text = corpus[i];
    const ids = (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
    const rec = { text, ids };
    if (i % 40 === 0) rec.ids_bos = (await tok.encode(text, null, { addSpecialTokens: true })).getIds();
    const plain = (await plainTok.encode(text, null, { addSpecialTokens: false })).getIds();
    if (JSON.stringify(plain) !== JSON.stringify(ids)) rec.plain_ids = plain;
    const decoded = await tok.decode(ids, false);
    const decodedSkip = await tok.decode(ids, true);
    if (decoded !== text) rec.decoded = decoded;
    if (decodedSkip !== decoded) rec.decoded_skip = decodedSkip;
    lines.push(JSON.stringify(rec));
  }
  for (const ids of decodeCases) {
    lines.push(JSON.stringify({ decode_ids: ids, decoded: await tok.decode(ids, false),
                                decoded_skip: await tok.decode(ids, true) }));
  }
  fs.mkdirSync(outDir, { recursive: true });
  const out = path.join(outDir, 'corpus.jsonl.xz');
  const compressed = execFileSync('xz', ['-9e', '-c'], { input: lines.join('\n') + '\n', maxBuffer: 1 << 30 });
  fs.writeFileSync(out, compressed);
  const chars = corpus.reduce((a, s) => a + s.length, 0);
  console.log(`wrote ${out}: ${corpus.length} strings (${chars} UTF-16 units), ${decodeCases.length} decode cases, ` +
              `${compressed.length} bytes`);
}

await main();
