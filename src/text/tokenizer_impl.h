#pragma once
// Internal state of dg::text::Tokenizer, shared by the loader (tokenizer_load.cpp) and the encoder/decoder
// (tokenizer.cpp). Not part of the public API.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "text/tokenizer.h"

namespace dg::text {

// Open-addressing map from token string to id. The strings live in the owner's arena, so a 262k-entry vocab costs
// one int32 per slot instead of a node allocation per token.
class TokenStringIndex {
 public:
  void reset(size_t expected_entries);
  // Returns the existing id if `text` is already present (the caller decides whether that is an error).
  TokenId insert(std::string_view text, TokenId id, const std::string& arena, const std::vector<uint32_t>& offsets) {
    return insert_hashed(text, hash(text), id, arena, offsets);
  }
  TokenId insert_hashed(std::string_view text, size_t hash, TokenId id, const std::string& arena,
                        const std::vector<uint32_t>& offsets);
  TokenId find(std::string_view text, const std::string& arena, const std::vector<uint32_t>& offsets) const {
    return find_hashed(text, hash(text), arena, offsets);
  }
  // Split lookup so the loader can hash and prefetch a batch of keys before resolving them.
  static size_t hash(std::string_view text);
  void prefetch(size_t hash) const { __builtin_prefetch(&slots_[hash & mask_]); }
  TokenId find_hashed(std::string_view text, size_t hash, const std::string& arena,
                      const std::vector<uint32_t>& offsets) const;

 private:
  // Loading resolves ~1.5M merge strings; keeping the first bytes of the token in the slot makes a lookup one
  // cache miss instead of three (slot, offsets, arena). Most tokens fit entirely.
  static constexpr size_t kInlineBytes = 11;
  struct Slot {
    TokenId id;       // -1 = empty
    uint8_t length;   // min(token length, 255)
    char head[kInlineBytes];
  };
  static bool matches(const Slot& s, std::string_view text, const std::string& arena,
                      const std::vector<uint32_t>& offsets);
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

struct MergeResult {
  uint32_t rank;
  TokenId merged_id;
};

// Open-addressing map (left id, right id) -> (rank, merged id); the hot lookup of the BPE loop.
class MergeTable {
 public:
  void reset(size_t expected_entries);
  // A later duplicate pair overwrites the earlier one, as HF's HashMap collect does.
  void insert_or_assign(TokenId left, TokenId right, MergeResult result);
  void prefetch(TokenId left, TokenId right) const { __builtin_prefetch(&entries_[hash(pack(left, right)) & mask_]); }
  const MergeResult* find(TokenId left, TokenId right) const {
    uint64_t key = pack(left, right);
    for (size_t slot = hash(key) & mask_;; slot = (slot + 1) & mask_) {
      const Entry& e = entries_[slot];
      if (e.key == key) return &e.result;
      if (e.key == kEmpty) return nullptr;
    }
  }
  size_t size() const { return size_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t(0);
  struct Entry {
    uint64_t key = kEmpty;
    MergeResult result{};
  };
  static uint64_t pack(TokenId left, TokenId right) { return (uint64_t(uint32_t(left)) << 32) | uint32_t(right); }
  static size_t hash(uint64_t key) {
    uint64_t h = key * 0x9E3779B97F4A7C15ull;  // the high product bits depend on both ids
    return size_t(h ^ (h >> 32));
  }
  std::vector<Entry> entries_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

struct AddedToken {
  std::string content;
  TokenId id;
  bool special;
};

// Byte trie over added-token contents for leftmost-longest matching (what HF's Aho-Corasick split does).
class AddedTokenTrie {
 public:
  void build(const std::vector<AddedToken>& tokens);
  bool empty() const { return nodes_.size() <= 1; }
  bool may_start_with(uint8_t byte) const { return first_byte_[byte]; }
  // Longest added token starting at text[pos]: returns its length and sets `id`, or 0 if none starts there.
  size_t longest_match(std::string_view text, size_t pos, TokenId& id) const;

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;
    TokenId token = -1;
  };
  std::vector<Node> nodes_;
  bool first_byte_[256] = {};
};

class CodePointSet {
 public:
  CodePointSet() : bits_(0x110000 / 64, 0) {}
  void insert(uint32_t cp) { bits_[cp >> 6] |= uint64_t(1) << (cp & 63); }
  bool contains(uint32_t cp) const { return (bits_[cp >> 6] >> (cp & 63)) & 1; }

 private:
  std::vector<uint64_t> bits_;
};

enum TokenFlags : uint8_t {
  kTokenPresent = 1,
  kTokenAdded = 2,
  kTokenSpecial = 4,
};

struct Tokenizer::Impl {
  std::string source;  // file name for error messages

  // Id-indexed token strings: token i is arena[offsets[i], offsets[i+1]).
  std::string token_arena;
  std::vector<uint32_t> token_offsets;
  std::string decoded_arena;  // same layout, with the decoder's Replace applied
  std::vector<uint32_t> decoded_offsets;
  std::vector<uint8_t> flags;        // TokenFlags per id
  std::vector<int16_t> fallback_byte;  // byte value of "<0xHH>" tokens, else -1
  TokenStringIndex model_index;      // model vocab strings (merges and characters are resolved against these)
  TokenStringIndex added_only_index;  // added tokens that are not in the model vocab

  MergeTable merges;
  bool ignore_merges = false;
  std::vector<TokenId> char_to_id;  // code point -> id of the single-character token, or -1
  TokenId byte_to_id[256];

  // Normalizer Replace(normalize_from -> normalize_to); empty `from` means no normalizer.
  std::string normalize_from, normalize_to;
  std::vector<AddedToken> added_tokens;
  AddedTokenTrie added_trie;

  // Word splitting. HF runs the BPE over a whole segment (Gemma has no real pre-tokenizer), which costs
  // O(n log n) per segment and misses the cache on long lines. The loader proves, from the vocab, between which
  // characters no merge can ever cross; the segment is cut there into independent words, which gives identical
  // ids (a merge across the cut would create a token containing that adjacent pair, and none exists).
  // Only characters in `boundary_chars` (▁, \n, \t) are considered, and only when no merge uses a byte token.
  bool split_words = false;
  std::vector<uint32_t> boundary_chars;
  // Per boundary char: bitsets over all code points of the characters that precede / follow it inside some token.
  std::vector<CodePointSet> joins_before, joins_after;

  std::vector<TokenId> template_prefix, template_suffix;  // post-processor "single" template around the sequence
  TokenId bos = -1, eos = -1, pad = -1;

  std::string_view token(TokenId id) const {
    return std::string_view(token_arena).substr(token_offsets[id], token_offsets[id + 1] - token_offsets[id]);
  }
  std::string_view decoded(TokenId id) const {
    return std::string_view(decoded_arena)
        .substr(decoded_offsets[id], decoded_offsets[id + 1] - decoded_offsets[id]);
  }
  size_t id_count() const { return flags.size(); }
};

std::unique_ptr<Tokenizer::Impl> load_tokenizer_json(std::string_view json_text, const std::string& source);

}  // namespace dg::text
