#pragma once
// Exact re-implementation of the Hugging Face `tokenizers` pipeline used by Gemma 4 / DiffusionGemma:
// added-token split (leftmost-longest) -> Replace(" " -> "▁") -> BPE over the whole segment with byte fallback
// -> optional post-processor template (<bos>). Decoding mirrors Replace("▁" -> " ") + ByteFallback + Fuse, including
// HF's rule that a byte-fallback run which is not valid UTF-8 becomes one U+FFFD per byte.
// Any tokenizer.json feature outside this family is rejected at load time with a dg::Error instead of being
// silently mis-tokenized.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dg::text {

using TokenId = int32_t;

class Tokenizer {
 public:
  // Loads tokenizer.json or an xz-compressed copy (recognised by content, whatever the file name).
  static Tokenizer from_file(const std::filesystem::path& path);
  // Looks for tokenizer.json, then tokenizer.json.xz, inside a model directory.
  static Tokenizer from_model_dir(const std::filesystem::path& dir);
  // `source` names the data in error messages.
  static Tokenizer from_json(std::string_view json_text, const std::string& source);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // HF `encode(text, add_special_tokens)`. `text` must be valid UTF-8 (dg::Error otherwise).
  // parse_special=false treats added/special-token text such as "<|turn>" as plain text (the BPE then spells it out
  // with ordinary pieces), which is what untrusted user content needs.
  std::vector<TokenId> encode(std::string_view text, bool add_special_tokens = false, bool parse_special = true) const;

  // HF `decode(ids, skip_special_tokens)`. Unlike HF, which silently drops unknown ids, an id outside the
  // vocabulary is a dg::Error: it can only come from a bug or a mismatched model.
  std::string decode(std::span<const TokenId> ids, bool skip_special = false) const;

  // Number of ids (model vocab plus added tokens), i.e. one more than the largest valid id.
  size_t vocab_size() const;
  std::optional<TokenId> token_to_id(std::string_view token) const;
  // The raw vocabulary string (e.g. "▁hello", "<0x0A>", "<|turn>"); dg::Error for an id outside the vocabulary.
  std::string_view id_to_token(TokenId id) const;
  // True for added tokens flagged "special" (those decode(skip_special=true) drops).
  bool is_special(TokenId id) const;
  bool is_added(TokenId id) const;
  TokenId bos_id() const;
  TokenId eos_id() const;
  TokenId pad_id() const;

  // Longest added token (e.g. "<|turn>") starting exactly at text[pos], as the encoder's leftmost-longest split sees
  // it: returns its byte length and sets `id`, or returns 0. Lets callers mix trusted markup with untrusted text.
  size_t match_added_token(std::string_view text, size_t pos, TokenId& id) const;

  // Decoding building blocks, shared with IncrementalDecoder.
  bool is_valid_id(TokenId id) const;
  // Byte value of a byte-fallback token such as "<0xE2>", or -1.
  int fallback_byte(TokenId id) const;
  // Text a non-byte token contributes to decode() ("▁" already replaced by a space).
  std::string_view decoded_text(TokenId id) const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Streaming detokenizer: push ids as they are generated and get back only text that can no longer change.
// Ordinary tokens are released immediately; a run of byte-fallback tokens is held back until the run ends
// (the next non-byte token, or finish()), because HF decides the whole run at once: valid UTF-8 is emitted as is,
// otherwise every byte of the run becomes U+FFFD. The concatenation of all returned strings therefore always
// equals Tokenizer::decode of all pushed ids.
class IncrementalDecoder {
 public:
  explicit IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special = false);

  std::string push(TokenId id);
  std::string push(std::span<const TokenId> ids);
  // End of stream: resolves a pending byte run.
  std::string finish();
  // True while bytes are held back.
  bool has_pending() const { return !pending_bytes_.empty(); }
  void reset() { pending_bytes_.clear(); }

 private:
  void push_into(TokenId id, std::string& out);
  void flush_into(std::string& out);

  const Tokenizer* tokenizer_;
  bool skip_special_;
  std::string pending_bytes_;
};

// Strict UTF-8 validation with the same rules as Rust's String::from_utf8 (no overlongs, surrogates or > U+10FFFF).
bool is_valid_utf8(std::string_view bytes);

}  // namespace dg::text
