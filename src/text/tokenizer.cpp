#include "text/tokenizer.h"

#include <algorithm>
#include <cstring>

#include "text/tokenizer_impl.h"
#include "util/error.h"
#include "util/xz.h"

namespace dg::text {

namespace {

constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// Length of the valid UTF-8 sequence starting at s[i], or 0 if it is invalid (Rust/Unicode "well-formed" rules).
size_t utf8_sequence_length(std::string_view s, size_t i) {
  auto at = [&](size_t k) { return uint8_t(s[k]); };
  uint8_t c = at(i);
  if (c < 0x80) return 1;
  size_t n = s.size() - i;
  auto cont = [&](size_t k) { return (at(i + k) & 0xC0) == 0x80; };
  if (c >= 0xC2 && c <= 0xDF) return n >= 2 && cont(1) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (n < 3 || !cont(1) || !cont(2)) return 0;
    uint8_t c1 = at(i + 1);
    if (c == 0xE0 && c1 < 0xA0) return 0;   // overlong
    if (c == 0xED && c1 >= 0xA0) return 0;  // UTF-16 surrogate
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (n < 4 || !cont(1) || !cont(2) || !cont(3)) return 0;
    uint8_t c1 = at(i + 1);
    if (c == 0xF0 && c1 < 0x90) return 0;   // overlong
    if (c == 0xF4 && c1 >= 0x90) return 0;  // above U+10FFFF
    return 4;
  }
  return 0;
}

uint32_t decode_code_point(const uint8_t* p, size_t len) {
  switch (len) {
    case 1: return p[0];
    case 2: return (uint32_t(p[0] & 0x1F) << 6) | (p[1] & 0x3F);
    case 3: return (uint32_t(p[0] & 0x0F) << 12) | (uint32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
    default:
      return (uint32_t(p[0] & 0x07) << 18) | (uint32_t(p[1] & 0x3F) << 12) | (uint32_t(p[2] & 0x3F) << 6) |
             (p[3] & 0x3F);
  }
}

// HF's ByteFallback decoder: a run of byte tokens is kept if it is valid UTF-8, otherwise every byte of the run
// (not just the offending ones) becomes U+FFFD.
void append_byte_run(std::string& out, std::string_view bytes) {
  if (is_valid_utf8(bytes)) {
    out.append(bytes);
  } else {
    for (size_t i = 0; i < bytes.size(); ++i) out.append(kReplacementChar);
  }
}

struct Symbol {
  TokenId id;
  int32_t prev;
  int32_t next;
  bool alive;
};

struct PendingMerge {
  uint32_t rank;
  int32_t pos;
  TokenId merged_id;
};

// Heap order of HF's word.rs `Merge`: lowest rank first, then leftmost position.
struct LowerPriority {
  bool operator()(const PendingMerge& a, const PendingMerge& b) const {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  }
};

struct EncodeScratch {
  std::string normalized;
  std::vector<Symbol> symbols;
  std::vector<PendingMerge> heap;
};

[[noreturn]] void fail_invalid_utf8(std::string_view text, size_t at) {
  fail("cannot tokenize: input text is not valid UTF-8 (bad byte 0x{:02X} at offset {} of {}); decode the input "
       "as UTF-8 before tokenizing",
       uint8_t(text[at]), at, text.size());
}

// The BPE model on one pre-tokenized "word" (for Gemma: a whole segment between added tokens).
void encode_word(const Tokenizer::Impl& t, std::string_view word, EncodeScratch& scratch,
                 std::vector<TokenId>& out) {
  if (word.empty()) return;
  if (t.ignore_merges) {
    TokenId whole = t.model_index.find(word, t.token_arena, t.token_offsets);
    if (whole >= 0) {
      out.push_back(whole);
      return;
    }
  }
  std::vector<Symbol>& symbols = scratch.symbols;
  symbols.clear();
  auto add_symbol = [&](TokenId id) {
    int32_t index = int32_t(symbols.size());
    symbols.push_back({id, index - 1, index + 1, true});
  };
  const auto* bytes = reinterpret_cast<const uint8_t*>(word.data());
  for (size_t i = 0; i < word.size();) {
    size_t len = bytes[i] < 0x80 ? 1 : utf8_sequence_length(word, i);
    // The caller validated the input and the normalizer only inserts valid UTF-8.
    TokenId id = t.char_to_id[decode_code_point(bytes + i, len)];
    if (id >= 0) {
      add_symbol(id);
    } else {
      for (size_t k = 0; k < len; ++k) add_symbol(t.byte_to_id[bytes[i + k]]);
    }
    i += len;
  }
  symbols.back().next = -1;

  // A faithful port of HF word.rs `merge_all`, including how it discards stale heap entries: an entry is applied
  // if the pair now at its position merges into the same id, whatever rank the entry was queued with.
  std::vector<PendingMerge>& heap = scratch.heap;
  heap.clear();
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const MergeResult* m = t.merges.find(symbols[i].id, symbols[i + 1].id))
      heap.push_back({m->rank, int32_t(i), m->merged_id});
  }
  std::make_heap(heap.begin(), heap.end(), LowerPriority{});
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), LowerPriority{});
    PendingMerge top = heap.back();
    heap.pop_back();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    const MergeResult* current = t.merges.find(left.id, right.id);
    if (!current || current->merged_id != top.merged_id) continue;
    left.id = top.merged_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (left.prev >= 0) {
      if (const MergeResult* m = t.merges.find(symbols[left.prev].id, left.id)) {
        heap.push_back({m->rank, left.prev, m->merged_id});
        std::push_heap(heap.begin(), heap.end(), LowerPriority{});
      }
    }
    if (left.next >= 0) {
      if (const MergeResult* m = t.merges.find(left.id, symbols[left.next].id)) {
        heap.push_back({m->rank, top.pos, m->merged_id});
        std::push_heap(heap.begin(), heap.end(), LowerPriority{});
      }
    }
  }
  for (const Symbol& s : symbols)
    if (s.alive) out.push_back(s.id);
}

// Cuts a normalized segment into independent BPE words where the loader proved no merge can cross.
void encode_words(const Tokenizer::Impl& t, std::string_view text, EncodeScratch& scratch,
                  std::vector<TokenId>& out) {
  if (!t.split_words) {
    encode_word(t, text, scratch, out);
    return;
  }
  auto boundary_index = [&](uint32_t cp) -> int {
    for (size_t k = 0; k < t.boundary_chars.size(); ++k)
      if (t.boundary_chars[k] == cp) return int(k);
    return -1;
  };
  const auto* bytes = reinterpret_cast<const uint8_t*>(text.data());
  size_t word_start = 0;
  uint32_t prev = UINT32_MAX;
  int prev_boundary = -1;
  for (size_t i = 0; i < text.size();) {
    size_t len = bytes[i] < 0x80 ? 1 : utf8_sequence_length(text, i);
    uint32_t cp = decode_code_point(bytes + i, len);
    int boundary = boundary_index(cp);
    if (i > 0 && cp != prev) {
      bool cut = boundary >= 0        ? !t.joins_before[boundary].contains(prev)
                 : prev_boundary >= 0 ? !t.joins_after[prev_boundary].contains(cp)
                                      : false;
      if (cut) {
        encode_word(t, text.substr(word_start, i - word_start), scratch, out);
        word_start = i;
      }
    }
    prev = cp;
    prev_boundary = boundary;
    i += len;
  }
  encode_word(t, text.substr(word_start), scratch, out);
}

void encode_segment(const Tokenizer::Impl& t, std::string_view segment, EncodeScratch& scratch,
                    std::vector<TokenId>& out) {
  if (segment.empty()) return;
  if (t.normalize_from.empty()) {
    encode_words(t, segment, scratch, out);
    return;
  }
  std::string& normalized = scratch.normalized;
  normalized.clear();
  const std::string& from = t.normalize_from;
  for (size_t at; (at = segment.find(from)) != std::string_view::npos; segment.remove_prefix(at + from.size()))
    normalized.append(segment.substr(0, at)).append(t.normalize_to);
  normalized.append(segment);
  encode_words(t, normalized, scratch, out);
}

}  // namespace

bool is_valid_utf8(std::string_view bytes) {
  size_t i = 0, n = bytes.size();
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t chunk;
      std::memcpy(&chunk, bytes.data() + i, 8);
      if (chunk & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    size_t len = utf8_sequence_length(bytes, i);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------------------------

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_json(std::string_view json_text, const std::string& source) {
  return Tokenizer(load_tokenizer_json(json_text, source));
}

Tokenizer Tokenizer::from_file(const std::filesystem::path& path) {
  std::string text = read_file_maybe_xz(path.string());
  return from_json(text, path.string());
}

Tokenizer Tokenizer::from_model_dir(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    fail("model directory {} does not exist or is not a directory", dir.string());
  for (const char* name : {"tokenizer.json", "tokenizer.json.xz"}) {
    std::filesystem::path candidate = dir / name;
    if (std::filesystem::exists(candidate, ec)) return from_file(candidate);
  }
  fail("no tokenizer in {}: expected tokenizer.json or tokenizer.json.xz (copy the Hugging Face tokenizer.json of "
       "the checkpoint there, or pass --tokenizer FILE)",
       dir.string());
}

std::vector<TokenId> Tokenizer::encode(std::string_view text, bool add_special_tokens, bool parse_special) const {
  const Impl& t = *impl_;
  for (size_t i = 0; i < text.size();) {
    if (uint8_t(text[i]) < 0x80) {
      ++i;
      continue;
    }
    size_t len = utf8_sequence_length(text, i);
    if (len == 0) fail_invalid_utf8(text, i);
    i += len;
  }

  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 4);
  if (add_special_tokens) out.insert(out.end(), t.template_prefix.begin(), t.template_prefix.end());
  EncodeScratch scratch;
  if (parse_special && !t.added_trie.empty()) {
    size_t segment_start = 0;
    for (size_t i = 0; i < text.size();) {
      TokenId id = -1;
      size_t match = t.added_trie.may_start_with(uint8_t(text[i])) ? t.added_trie.longest_match(text, i, id) : 0;
      if (match == 0) {
        ++i;
        continue;
      }
      encode_segment(t, text.substr(segment_start, i - segment_start), scratch, out);
      out.push_back(id);
      i += match;
      segment_start = i;
    }
    encode_segment(t, text.substr(segment_start), scratch, out);
  } else {
    encode_segment(t, text, scratch, out);
  }
  if (add_special_tokens) out.insert(out.end(), t.template_suffix.begin(), t.template_suffix.end());
  return out;
}

std::string Tokenizer::decode(std::span<const TokenId> ids, bool skip_special) const {
  IncrementalDecoder decoder(*this, skip_special);
  std::string out = decoder.push(ids);
  out += decoder.finish();
  return out;
}

size_t Tokenizer::match_added_token(std::string_view text, size_t pos, TokenId& id) const {
  const AddedTokenTrie& trie = impl_->added_trie;
  if (pos >= text.size() || trie.empty() || !trie.may_start_with(uint8_t(text[pos]))) return 0;
  return trie.longest_match(text, pos, id);
}

size_t Tokenizer::vocab_size() const { return impl_->id_count(); }

std::optional<TokenId> Tokenizer::token_to_id(std::string_view token) const {
  const Impl& t = *impl_;
  TokenId id = t.model_index.find(token, t.token_arena, t.token_offsets);
  if (id < 0) id = t.added_only_index.find(token, t.token_arena, t.token_offsets);
  if (id < 0) return std::nullopt;
  return id;
}

bool Tokenizer::is_valid_id(TokenId id) const {
  return id >= 0 && size_t(id) < impl_->id_count() && (impl_->flags[id] & kTokenPresent);
}

static void require_valid_id(const Tokenizer& tok, TokenId id, size_t vocab_size) {
  if (!tok.is_valid_id(id))
    fail("token id {} is not in the vocabulary (valid ids are 0..{}); was it produced by a different model?", id,
         vocab_size - 1);
}

std::string_view Tokenizer::id_to_token(TokenId id) const {
  require_valid_id(*this, id, vocab_size());
  return impl_->token(id);
}

bool Tokenizer::is_special(TokenId id) const { return is_valid_id(id) && (impl_->flags[id] & kTokenSpecial); }
bool Tokenizer::is_added(TokenId id) const { return is_valid_id(id) && (impl_->flags[id] & kTokenAdded); }
TokenId Tokenizer::bos_id() const { return impl_->bos; }
TokenId Tokenizer::eos_id() const { return impl_->eos; }
TokenId Tokenizer::pad_id() const { return impl_->pad; }

int Tokenizer::fallback_byte(TokenId id) const {
  require_valid_id(*this, id, vocab_size());
  return impl_->fallback_byte[id];
}

std::string_view Tokenizer::decoded_text(TokenId id) const {
  require_valid_id(*this, id, vocab_size());
  return impl_->decoded(id);
}

// ---------------------------------------------------------------------------------------------------------------

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special)
    : tokenizer_(&tokenizer), skip_special_(skip_special) {}

void IncrementalDecoder::push_into(TokenId id, std::string& out) {
  // Skipped specials are removed before the ByteFallback step in HF, so they do not end a byte run.
  if (skip_special_ && tokenizer_->is_special(id)) return;
  int byte = tokenizer_->fallback_byte(id);
  if (byte >= 0) {
    pending_bytes_.push_back(char(byte));
    return;
  }
  flush_into(out);
  out.append(tokenizer_->decoded_text(id));
}

void IncrementalDecoder::flush_into(std::string& out) {
  if (pending_bytes_.empty()) return;
  append_byte_run(out, pending_bytes_);
  pending_bytes_.clear();
}

std::string IncrementalDecoder::push(TokenId id) {
  std::string out;
  push_into(id, out);
  return out;
}

std::string IncrementalDecoder::push(std::span<const TokenId> ids) {
  std::string out;
  for (TokenId id : ids) push_into(id, out);
  return out;
}

std::string IncrementalDecoder::finish() {
  std::string out;
  flush_into(out);
  return out;
}

}  // namespace dg::text
