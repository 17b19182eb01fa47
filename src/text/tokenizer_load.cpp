// Loader for HF tokenizer.json. The 262k-entry vocab and 515k merges are scanned by hand (nlohmann would build
// ~1.3M heap nodes, several hundred ms); every other, small, section is handed to nlohmann::json.
#include <charconv>
#include <cstring>
#include <nlohmann/json.hpp>

#include "text/tokenizer_impl.h"
#include "util/error.h"

namespace dg::text {

namespace {

using nlohmann::json;

constexpr TokenId kMaxTokenId = (1 << 24) - 1;  // far above any real vocab; keeps the id arrays bounded

size_t hash_bytes(std::string_view s) {
  // Tokens are short: mix 8-byte words with a multiply (much faster than a byte loop on 1.5M lookups at load).
  uint64_t h = 0x9E3779B97F4A7C15ull ^ s.size();
  const char* p = s.data();
  size_t n = s.size();
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  }
  if (n > 0) {
    uint64_t w = 0;
    std::memcpy(&w, p, n);
    h = (h ^ w) * 0x94D049BB133111EBull;
    h ^= h >> 29;
  }
  h *= 0xBF58476D1CE4E5B9ull;
  return size_t(h ^ (h >> 32));
}

size_t table_capacity(size_t entries) {
  size_t cap = 16;
  while (cap < entries * 2) cap <<= 1;  // load factor <= 0.5 keeps probe chains short
  return cap;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

// Returns the code point of `s` if it is exactly one UTF-8 encoded character, else -1. Assumes valid UTF-8.
int32_t single_code_point(std::string_view s) {
  if (s.empty()) return -1;
  auto b = [&](size_t i) { return uint32_t(uint8_t(s[i])); };
  uint32_t c = b(0);
  if (c < 0x80) return s.size() == 1 ? int32_t(c) : -1;
  if (c < 0xE0) return s.size() == 2 ? int32_t(((c & 0x1F) << 6) | (b(1) & 0x3F)) : -1;
  if (c < 0xF0) return s.size() == 3 ? int32_t(((c & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F)) : -1;
  return s.size() == 4 ? int32_t(((c & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F))
                       : -1;
}

size_t utf8_length(uint8_t lead) { return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4; }

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// HF's ByteFallback decoder accepts any 6-char "<0x..>" token whose two characters parse with Rust's
// u8::from_str_radix(.., 16), which also accepts a leading '+'.
int parse_fallback_byte(std::string_view token) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return -1;
  if (token[3] == '+') return hex_digit(token[4]);
  int hi = hex_digit(token[3]), lo = hex_digit(token[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// Minimal strict JSON scanner over the whole file; reports errors with line and column.
class JsonScanner {
 public:
  JsonScanner(std::string_view text, const std::string& source) : text_(text), source_(source) {}

  [[noreturn]] void error(std::string_view what) const { error_at(pos_, what); }
  [[noreturn]] void error_at(size_t pos, std::string_view what) const {
    size_t line = 1, line_start = 0;
    for (size_t i = 0; i < pos && i < text_.size(); ++i)
      if (text_[i] == '\n') line++, line_start = i + 1;
    fail("{}: invalid tokenizer JSON at line {}, column {}: {} (the file must be a Hugging Face tokenizer.json)",
         source_, line, pos - line_start + 1, what);
  }

  size_t pos() const { return pos_; }
  void set_pos(size_t pos) { pos_ = pos; }

  void skip_ws() {
    while (pos_ < text_.size() &&
           (text_[pos_] == ' ' || text_[pos_] == '\n' || text_[pos_] == '\r' || text_[pos_] == '\t'))
      ++pos_;
  }
  char peek() {
    skip_ws();
    if (pos_ >= text_.size()) error("unexpected end of file");
    return text_[pos_];
  }
  bool consume(char c) {
    if (peek() != c) return false;
    ++pos_;
    return true;
  }
  void expect(char c, std::string_view context) {
    if (!consume(c)) error(dg::format("expected '{}' {}, found '{}'", c, context, printable(text_[pos_])));
  }
  bool at_end() {
    skip_ws();
    return pos_ >= text_.size();
  }

  void read_string(std::string& out) {
    out.clear();
    if (peek() != '"') error(dg::format("expected a string, found '{}'", printable(text_[pos_])));
    ++pos_;
    for (;;) {
      size_t run = pos_;
      while (run < text_.size() && text_[run] != '"' && text_[run] != '\\' && uint8_t(text_[run]) >= 0x20) ++run;
      out.append(text_.data() + pos_, run - pos_);
      pos_ = run;
      if (pos_ >= text_.size()) error("unterminated string");
      char c = text_[pos_++];
      if (c == '"') return;
      if (c != '\\') error_at(pos_ - 1, "control character inside a string (must be escaped)");
      if (pos_ >= text_.size()) error("unterminated escape");
      char e = text_[pos_++];
      switch (e) {
        case '"': out.push_back('"'); break;
        case '\\': out.push_back('\\'); break;
        case '/': out.push_back('/'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'u': {
          uint32_t cp = read_hex4();
          if (cp >= 0xD800 && cp < 0xDC00) {
            if (pos_ + 2 > text_.size() || text_[pos_] != '\\' || text_[pos_ + 1] != 'u')
              error("lone UTF-16 high surrogate in \\u escape");
            pos_ += 2;
            uint32_t low = read_hex4();
            if (low < 0xDC00 || low >= 0xE000) error("invalid UTF-16 low surrogate in \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            error("lone UTF-16 low surrogate in \\u escape");
          }
          append_utf8(out, cp);
          break;
        }
        default: error_at(pos_ - 1, dg::format("invalid escape '\\{}'", printable(e)));
      }
    }
  }

  int64_t read_int() {
    skip_ws();
    int64_t value = 0;
    auto [end, ec] = std::from_chars(text_.data() + pos_, text_.data() + text_.size(), value);
    if (ec != std::errc() || end == text_.data() + pos_) error("expected an integer");
    size_t next = size_t(end - text_.data());
    if (next < text_.size() && (text_[next] == '.' || text_[next] == 'e' || text_[next] == 'E'))
      error("expected an integer, found a fractional number");
    pos_ = next;
    return value;
  }

  // Skips one value of any type and returns its text.
  std::string_view skip_value() {
    skip_ws();
    size_t start = pos_;
    int depth = 0;
    do {
      if (pos_ >= text_.size()) error("unexpected end of file inside a value");
      char c = text_[pos_];
      if (c == '"') {
        ++pos_;
        while (pos_ < text_.size() && text_[pos_] != '"') pos_ += text_[pos_] == '\\' ? 2 : 1;
        if (pos_ >= text_.size()) error_at(start, "unterminated string");
        ++pos_;
      } else if (c == '{' || c == '[') {
        ++depth, ++pos_;
      } else if (c == '}' || c == ']') {
        if (depth == 0) error("unbalanced bracket");
        --depth, ++pos_;
      } else if (depth == 0) {
        while (pos_ < text_.size() && text_[pos_] != ',' && text_[pos_] != '}' && text_[pos_] != ']' &&
               text_[pos_] != ' ' && text_[pos_] != '\n' && text_[pos_] != '\r' && text_[pos_] != '\t')
          ++pos_;
      } else {
        ++pos_;
      }
    } while (depth > 0);
    return text_.substr(start, pos_ - start);
  }

  json parse_small_value(std::string_view field) {
    size_t start = pos_;
    std::string_view span = skip_value();
    try {
      return json::parse(span);
    } catch (const json::exception& e) {
      error_at(start, dg::format("field '{}': {}", field, e.what()));
    }
  }

 private:
  static std::string printable(char c) {
    if (uint8_t(c) >= 0x20 && uint8_t(c) < 0x7F) return std::string(1, c);
    return dg::format("\\x{:02X}", uint8_t(c));
  }
  uint32_t read_hex4() {
    if (pos_ + 4 > text_.size()) error("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      int d = hex_digit(text_[pos_ + i]);
      if (d < 0) error("invalid hex digit in \\u escape");
      v = v * 16 + uint32_t(d);
    }
    pos_ += 4;
    return v;
  }

  std::string_view text_;
  const std::string& source_;
  size_t pos_ = 0;
};

class Loader {
 public:
  Loader(std::string_view text, const std::string& source) : scan_(text, source), source_(source), text_(text) {}

  std::unique_ptr<Tokenizer::Impl> load() {
    if (!is_valid_utf8(text_)) fail("{}: not valid UTF-8; a tokenizer.json is always UTF-8 text", source_);
    impl_ = std::make_unique<Tokenizer::Impl>();
    impl_->source = source_;
    scan_top_level();
    check_model_options();
    if (!have_vocab_) fail("{}: missing field 'model.vocab'", source_);
    if (!have_merges_) fail("{}: missing field 'model.merges'", source_);
    parse_vocab();
    read_added_tokens();
    build_id_tables();
    parse_merges();
    configure_normalizer();
    configure_word_splitting();
    check_pre_tokenizer();
    configure_post_processor();
    configure_decoder();
    check_unsupported_top_level();
    resolve_named_ids();
    return std::move(impl_);
  }

 private:
  // ---- top-level scan: vocab/merges spans are remembered, everything else becomes small nlohmann values ----
  void scan_top_level() {
    scan_.expect('{', "at the start of the file");
    if (!scan_.consume('}')) {
      std::string key;
      do {
        scan_.read_string(key);
        scan_.expect(':', "after an object key");
        if (key == "model") {
          scan_model();
        } else {
          top_[key] = scan_.parse_small_value(key);
        }
      } while (scan_.consume(','));
      scan_.expect('}', "to close the top-level object");
    }
    if (!scan_.at_end()) scan_.error("trailing data after the top-level object");
    if (!have_model_) fail("{}: missing field 'model' (not a Hugging Face tokenizer.json)", source_);
  }

  void scan_model() {
    have_model_ = true;
    scan_.expect('{', "to open 'model'");
    if (scan_.consume('}')) return;
    std::string key;
    do {
      scan_.read_string(key);
      scan_.expect(':', "after an object key");
      if (key == "vocab") {
        have_vocab_ = true;
        vocab_pos_ = scan_.pos();
        scan_.skip_value();
      } else if (key == "merges") {
        have_merges_ = true;
        merges_pos_ = scan_.pos();
        scan_.skip_value();
      } else {
        model_[key] = scan_.parse_small_value("model." + key);
      }
    } while (scan_.consume(','));
    scan_.expect('}', "to close 'model'");
  }

  // ---- model options ----
  [[noreturn]] void unsupported(std::string_view field, const json& value, std::string_view supported) const {
    fail("{}: unsupported {} = {}; this tokenizer implements the Gemma family only ({})", source_, field,
         value.dump(), supported);
  }

  void check_model_options() {
    auto get = [&](const char* key) { return model_.contains(key) ? model_[key] : json(); };
    if (get("type") != "BPE") unsupported("model.type", get("type"), "\"BPE\"");
    for (const char* key : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"})
      if (!get(key).is_null()) unsupported(std::string("model.") + key, get(key), "null");
    if (get("byte_fallback") != true) unsupported("model.byte_fallback", get("byte_fallback"), "true");
    json ignore = get("ignore_merges");
    if (!ignore.is_null() && !ignore.is_boolean()) unsupported("model.ignore_merges", ignore, "true or false");
    impl_->ignore_merges = ignore.is_boolean() && ignore.get<bool>();
  }

  // ---- vocab ----
  void parse_vocab() {
    scan_.set_pos(vocab_pos_);
    scan_.expect('{', "to open 'model.vocab' (an object mapping token strings to ids)");
    std::string key;
    if (!scan_.consume('}')) {
      do {
        size_t entry_pos = scan_.pos();
        scan_.read_string(key);
        scan_.expect(':', "after a vocab token");
        int64_t id = scan_.read_int();
        if (id < 0 || id > kMaxTokenId)
          scan_.error_at(entry_pos, dg::format("model.vocab['{}'] = {} is not a valid id (0..{})", key, id,
                                                kMaxTokenId));
        if (size_t(id) >= model_spans_.size()) model_spans_.resize(size_t(id) + 1, {0, UINT32_MAX});
        if (model_spans_[id].second != UINT32_MAX)
          scan_.error_at(entry_pos, dg::format("model.vocab: id {} is used twice", id));
        model_spans_[id] = {uint32_t(file_order_arena_.size()), uint32_t(key.size())};
        file_order_arena_ += key;
        ++model_count_;
      } while (scan_.consume(','));
      scan_.expect('}', "to close 'model.vocab'");
    }
    if (model_count_ == 0) fail("{}: model.vocab is empty", source_);
  }

  std::string_view model_token(TokenId id) const {
    if (size_t(id) >= model_spans_.size() || model_spans_[id].second == UINT32_MAX) return {};
    return std::string_view(file_order_arena_).substr(model_spans_[id].first, model_spans_[id].second);
  }
  bool is_model_id(TokenId id) const {
    return size_t(id) < model_spans_.size() && model_spans_[id].second != UINT32_MAX;
  }

  // ---- added tokens ----
  void read_added_tokens() {
    json added = top_.contains("added_tokens") ? top_["added_tokens"] : json::array();
    if (!added.is_array()) fail("{}: 'added_tokens' must be an array, found {}", source_, added.type_name());
    for (size_t i = 0; i < added.size(); ++i) {
      const json& a = added[i];
      std::string where = dg::format("added_tokens[{}]", i);
      if (!a.is_object() || !a.contains("id") || !a.contains("content") || !a["id"].is_number_integer() ||
          !a["content"].is_string())
        fail("{}: {} must be an object with an integer 'id' and a string 'content', found {}", source_, where,
             a.dump());
      int64_t id = a["id"].get<int64_t>();
      std::string content = a["content"].get<std::string>();
      if (id < 0 || id > kMaxTokenId) fail("{}: {}.id = {} is out of range (0..{})", source_, where, id, kMaxTokenId);
      if (content.empty()) fail("{}: {} has empty content", source_, where);
      for (const char* flag : {"single_word", "lstrip", "rstrip", "normalized"}) {
        if (a.contains(flag) && a[flag] != false)
          fail("{}: {} ('{}') has {} = {}; only false is supported (as in the Gemma tokenizer.json)", source_,
               where, content, flag, a[flag].dump());
      }
      if (is_model_id(TokenId(id)) && model_token(TokenId(id)) != content)
        fail("{}: {} ('{}') has id {}, which model.vocab already uses for '{}'", source_, where, content, id,
             model_token(TokenId(id)));
      for (const AddedToken& prev : impl_->added_tokens)
        if (prev.id == id || prev.content == content)
          fail("{}: {} ('{}', id {}) duplicates another added token ('{}', id {})", source_, where, content, id,
               prev.content, prev.id);
      bool special = a.contains("special") && a["special"] == true;
      impl_->added_tokens.push_back({std::move(content), TokenId(id), special});
    }
    impl_->added_trie.build(impl_->added_tokens);
  }

  // ---- final id-indexed tables ----
  void build_id_tables() {
    Tokenizer::Impl& t = *impl_;
    size_t count = model_spans_.size();
    for (const AddedToken& a : t.added_tokens) count = std::max(count, size_t(a.id) + 1);
    t.flags.assign(count, 0);
    std::vector<std::string_view> added_content(count);
    for (const AddedToken& a : t.added_tokens) {
      t.flags[a.id] |= kTokenPresent | kTokenAdded | (a.special ? kTokenSpecial : 0);
      added_content[a.id] = a.content;
    }
    std::vector<bool> in_model(count, false);
    t.token_arena.clear();
    t.token_arena.reserve(file_order_arena_.size() + 1024);
    t.token_offsets.assign(count + 1, 0);
    for (size_t id = 0; id < count; ++id) {
      t.token_offsets[id] = uint32_t(t.token_arena.size());
      if (is_model_id(TokenId(id))) {
        in_model[id] = true;
        t.flags[id] |= kTokenPresent;
        t.token_arena += model_token(TokenId(id));
      } else {
        t.token_arena += added_content[id];
      }
    }
    t.token_offsets[count] = uint32_t(t.token_arena.size());
    std::string().swap(file_order_arena_);
    model_spans_.clear();

    t.model_index.reset(model_count_);
    t.added_only_index.reset(t.added_tokens.size());
    // Hash everything first so the random slot accesses can be prefetched a few entries ahead.
    std::vector<size_t> hashes(count);
    for (size_t id = 0; id < count; ++id) hashes[id] = TokenStringIndex::hash(t.token(TokenId(id)));
    constexpr size_t kPrefetchDistance = 16;
    for (size_t id = 0; id < count; ++id) {
      if (id + kPrefetchDistance < count) t.model_index.prefetch(hashes[id + kPrefetchDistance]);
      if (!(t.flags[id] & kTokenPresent)) continue;
      std::string_view tok = t.token(TokenId(id));
      if (in_model[id]) {
        TokenId existing = t.model_index.insert_hashed(tok, hashes[id], TokenId(id), t.token_arena, t.token_offsets);
        if (existing != TokenId(id))
          fail("{}: model.vocab lists '{}' twice (ids {} and {})", source_, tok, existing, id);
      }
    }
    for (size_t id = 0; id < count; ++id) {
      if (!(t.flags[id] & kTokenPresent)) continue;
      std::string_view tok = t.token(TokenId(id));
      if (!in_model[id]) {
        TokenId model_id = t.model_index.find(tok, t.token_arena, t.token_offsets);
        if (model_id >= 0)
          fail("{}: added token '{}' has id {} but model.vocab maps it to {}", source_, tok, id, model_id);
        t.added_only_index.insert(tok, TokenId(id), t.token_arena, t.token_offsets);
      }
    }

    t.char_to_id.assign(0x110000, -1);
    t.fallback_byte.assign(count, -1);
    for (size_t id = 0; id < count; ++id) {
      if (!(t.flags[id] & kTokenPresent)) continue;
      std::string_view tok = t.token(TokenId(id));
      t.fallback_byte[id] = int16_t(parse_fallback_byte(tok));
      // The BPE model looks characters up in its own vocab only, never among added tokens.
      if (!in_model[id]) continue;
      int32_t cp = single_code_point(tok);
      if (cp >= 0) t.char_to_id[cp] = TokenId(id);
    }
    // The encoder spells a byte exactly as Rust's format!("<{:#04X}>") does.
    for (int b = 0; b < 256; ++b) {
      std::string name = dg::format("<0x{:02X}>", b);
      TokenId id = t.model_index.find(name, t.token_arena, t.token_offsets);
      if (id < 0)
        fail("{}: byte_fallback is on but model.vocab has no '{}' token; all 256 byte tokens <0x00>..<0xFF> are "
             "required", source_, name);
      t.byte_to_id[b] = id;
    }
  }

  // ---- merges ----
  // Each merge costs three vocab lookups and one merge-table insert, all random memory accesses; resolving merges in
  // batches with prefetches lets those cache misses overlap (about 3x faster on the 515k Gemma merges).
  struct MergeText {
    size_t json_pos;
    uint32_t offset, left_length, right_length;  // left+right stored contiguously in the batch arena
    size_t left_hash, right_hash, joined_hash;
    TokenId left, right, merged;
  };

  void parse_merges() {
    scan_.set_pos(merges_pos_);
    scan_.expect('[', "to open 'model.merges' (an array of \"a b\" strings or [\"a\", \"b\"] pairs)");
    impl_->merges.reset(impl_->id_count() * 2);
    constexpr size_t kBatch = 256;
    std::vector<MergeText> batch;
    batch.reserve(kBatch);
    std::string arena, left, right;
    uint32_t rank = 0;
    if (scan_.consume(']')) return;
    bool more = true;
    while (more) {
      batch.clear();
      arena.clear();
      while (more && batch.size() < kBatch) {
        size_t entry_pos = scan_.pos();
        read_merge(rank + uint32_t(batch.size()), left, right);
        MergeText m{entry_pos, uint32_t(arena.size()), uint32_t(left.size()), uint32_t(right.size()), 0, 0, 0,
                    -1, -1, -1};
        arena += left;
        arena += right;
        batch.push_back(m);
        more = scan_.consume(',');
      }
      const TokenStringIndex& index = impl_->model_index;
      for (MergeText& m : batch) {
        std::string_view joined(arena.data() + m.offset, m.left_length + m.right_length);
        m.left_hash = TokenStringIndex::hash(joined.substr(0, m.left_length));
        m.right_hash = TokenStringIndex::hash(joined.substr(m.left_length));
        m.joined_hash = TokenStringIndex::hash(joined);
        index.prefetch(m.left_hash);
        index.prefetch(m.right_hash);
        index.prefetch(m.joined_hash);
      }
      for (MergeText& m : batch) {
        std::string_view joined(arena.data() + m.offset, m.left_length + m.right_length);
        std::string_view l = joined.substr(0, m.left_length), r = joined.substr(m.left_length);
        m.left = index.find_hashed(l, m.left_hash, impl_->token_arena, impl_->token_offsets);
        m.right = index.find_hashed(r, m.right_hash, impl_->token_arena, impl_->token_offsets);
        m.merged = index.find_hashed(joined, m.joined_hash, impl_->token_arena, impl_->token_offsets);
        if (m.left < 0 || m.right < 0 || m.merged < 0) {
          std::string_view missing = m.left < 0 ? l : m.right < 0 ? r : joined;
          scan_.error_at(m.json_pos, dg::format("model.merges[{}] ('{}' + '{}') uses '{}', which is not in model.vocab",
                                                rank + (&m - batch.data()), l, r, missing));
        }
        if (impl_->fallback_byte[m.left] >= 0 || impl_->fallback_byte[m.right] >= 0) merges_use_byte_tokens_ = true;
        impl_->merges.prefetch(m.left, m.right);
      }
      for (const MergeText& m : batch) impl_->merges.insert_or_assign(m.left, m.right, {rank++, m.merged});
    }
    scan_.expect(']', "to close 'model.merges'");
  }

  void read_merge(uint32_t rank, std::string& left, std::string& right) {
    size_t entry_pos = scan_.pos();
    char c = scan_.peek();
    if (c == '"') {
      scan_.read_string(left);
      size_t space = left.find(' ');
      if (space == std::string::npos)
        scan_.error_at(entry_pos,
                       dg::format("model.merges[{}] = \"{}\" is not of the form \"left right\"", rank, left));
      right.assign(left, space + 1);
      left.resize(space);
    } else if (c == '[') {
      scan_.expect('[', "");
      scan_.read_string(left);
      scan_.expect(',', "between the two tokens of a model.merges pair");
      scan_.read_string(right);
      scan_.expect(']', "after the two tokens of a model.merges pair");
    } else {
      scan_.error_at(entry_pos, dg::format("model.merges[{}] must be a string or a pair of strings", rank));
    }
  }

  // ---- pipeline components ----
  static bool is_string_pattern(const json& j) {
    return j.is_object() && j.contains("pattern") && j["pattern"].is_object() && j["pattern"].contains("String") &&
           j["pattern"]["String"].is_string() && j.contains("content") && j["content"].is_string();
  }

  void configure_normalizer() {
    json n = top_.contains("normalizer") ? top_["normalizer"] : json();
    if (n.is_null()) return;
    if (!(n.is_object() && n.value("type", "") == "Replace" && is_string_pattern(n)))
      unsupported("normalizer", n, "null or Replace with a String pattern, e.g. \" \" -> \"▁\"");
    impl_->normalize_from = n["pattern"]["String"].get<std::string>();
    impl_->normalize_to = n["content"].get<std::string>();
    if (impl_->normalize_from.empty()) unsupported("normalizer", n, "a non-empty Replace pattern");
  }

  void configure_word_splitting() {
    Tokenizer::Impl& t = *impl_;
    if (t.ignore_merges || merges_use_byte_tokens_) return;
    t.boundary_chars = {'\n', '\t'};
    int32_t space_marker = single_code_point(t.normalize_to);
    if (space_marker > 0) t.boundary_chars.push_back(uint32_t(space_marker));
    t.joins_before.assign(t.boundary_chars.size(), CodePointSet());
    t.joins_after.assign(t.boundary_chars.size(), CodePointSet());
    std::vector<uint32_t> cps;
    for (size_t id = 0; id < t.id_count(); ++id) {
      if (!(t.flags[id] & kTokenPresent)) continue;
      std::string_view tok = t.token(TokenId(id));
      cps.clear();
      for (size_t i = 0; i < tok.size();) {
        size_t len = utf8_length(uint8_t(tok[i]));
        cps.push_back(uint32_t(single_code_point(tok.substr(i, len))));
        i += len;
      }
      for (size_t i = 0; i + 1 < cps.size(); ++i) {
        for (size_t k = 0; k < t.boundary_chars.size(); ++k) {
          if (cps[i + 1] == t.boundary_chars[k]) t.joins_before[k].insert(cps[i]);
          if (cps[i] == t.boundary_chars[k]) t.joins_after[k].insert(cps[i + 1]);
        }
      }
    }
    t.split_words = true;
  }

  void check_pre_tokenizer() {
    json p = top_.contains("pre_tokenizer") ? top_["pre_tokenizer"] : json();
    if (p.is_null()) return;
    // Gemma's Split(" ", MergedWithPrevious) runs after the normalizer has replaced every " ", so it never splits.
    const std::string& from = impl_->normalize_from;
    bool noop_split = p.is_object() && p.value("type", "") == "Split" && p.contains("pattern") &&
                      p["pattern"].is_object() && p["pattern"].contains("String") &&
                      p["pattern"]["String"].is_string() && !from.empty() && p["pattern"]["String"] == from &&
                      impl_->normalize_to.find(from) == std::string::npos && p.value("invert", false) == false;
    if (!noop_split)
      unsupported("pre_tokenizer", p, "null, or a Split on the string the normalizer replaces (a no-op)");
  }

  void configure_post_processor() {
    json p = top_.contains("post_processor") ? top_["post_processor"] : json();
    if (p.is_null()) return;
    if (!p.is_object() || p.value("type", "") != "TemplateProcessing" || !p.contains("single") ||
        !p["single"].is_array())
      unsupported("post_processor", p, "null or TemplateProcessing");
    bool seen_sequence = false;
    for (const json& item : p["single"]) {
      if (item.contains("Sequence")) {
        if (seen_sequence) unsupported("post_processor.single", p["single"], "one Sequence item");
        seen_sequence = true;
        continue;
      }
      if (!item.contains("SpecialToken") || !item["SpecialToken"].contains("id"))
        unsupported("post_processor.single item", item, "SpecialToken or Sequence");
      json name = item["SpecialToken"]["id"];
      if (!p.contains("special_tokens") || !name.is_string() || !p["special_tokens"].contains(name.get<std::string>()))
        fail("{}: post_processor.single refers to special token {}, which is not in post_processor.special_tokens",
             source_, name.dump());
      const json& ids = p["special_tokens"][name.get<std::string>()]["ids"];
      if (!ids.is_array()) fail("{}: post_processor.special_tokens[{}].ids must be an array", source_, name.dump());
      for (const json& id : ids) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || size_t(id.get<int64_t>()) >= impl_->id_count() ||
            !(impl_->flags[id.get<int64_t>()] & kTokenPresent))
          fail("{}: post_processor.special_tokens[{}] has id {}, which is not in the vocabulary", source_,
               name.dump(), id.dump());
        (seen_sequence ? impl_->template_suffix : impl_->template_prefix).push_back(TokenId(id.get<int64_t>()));
      }
    }
    if (!seen_sequence) unsupported("post_processor.single", p["single"], "a template containing Sequence A");
  }

  void configure_decoder() {
    Tokenizer::Impl& t = *impl_;
    json d = top_.contains("decoder") ? top_["decoder"] : json();
    const char* expected = "Sequence [Replace(\"▁\" -> \" \"), ByteFallback, Fuse]";
    if (!d.is_object() || d.value("type", "") != "Sequence" || !d.contains("decoders") || !d["decoders"].is_array() ||
        d["decoders"].size() != 3)
      unsupported("decoder", d, expected);
    const json& steps = d["decoders"];
    if (steps[0].value("type", "") != "Replace" || !is_string_pattern(steps[0]) ||
        steps[1].value("type", "") != "ByteFallback" || steps[2].value("type", "") != "Fuse")
      unsupported("decoder", d, expected);
    std::string from = steps[0]["pattern"]["String"].get<std::string>();
    std::string to = steps[0]["content"].get<std::string>();
    if (from.empty()) unsupported("decoder", d, "a non-empty Replace pattern");
    t.decoded_arena.clear();
    t.decoded_arena.reserve(t.token_arena.size());
    t.decoded_offsets.assign(t.id_count() + 1, 0);
    for (size_t id = 0; id < t.id_count(); ++id) {
      t.decoded_offsets[id] = uint32_t(t.decoded_arena.size());
      std::string_view tok = t.token(TokenId(id));
      for (size_t at; (at = tok.find(from)) != std::string_view::npos; tok.remove_prefix(at + from.size()))
        t.decoded_arena.append(tok.substr(0, at)).append(to);
      t.decoded_arena.append(tok);
    }
    t.decoded_offsets[t.id_count()] = uint32_t(t.decoded_arena.size());
  }

  void check_unsupported_top_level() {
    for (const char* key : {"truncation", "padding"})
      if (top_.contains(key) && !top_[key].is_null())
        unsupported(key, top_[key], "null (truncate or pad in the caller)");
  }

  void resolve_named_ids() {
    Tokenizer::Impl& t = *impl_;
    auto find = [&](const char* name) {
      TokenId id = t.model_index.find(name, t.token_arena, t.token_offsets);
      return id >= 0 ? id : t.added_only_index.find(name, t.token_arena, t.token_offsets);
    };
    t.bos = find("<bos>");
    t.eos = find("<eos>");
    t.pad = find("<pad>");
    if (t.bos < 0 || t.eos < 0)
      fail("{}: the vocabulary has no '{}' token; Gemma tokenizers define <bos> and <eos>", source_,
           t.bos < 0 ? "<bos>" : "<eos>");
  }

  JsonScanner scan_;
  const std::string& source_;
  std::string_view text_;
  std::unique_ptr<Tokenizer::Impl> impl_;
  json top_ = json::object();
  json model_ = json::object();
  bool have_model_ = false, have_vocab_ = false, have_merges_ = false;
  size_t vocab_pos_ = 0, merges_pos_ = 0;

  std::string file_order_arena_;
  std::vector<std::pair<uint32_t, uint32_t>> model_spans_;  // id -> (offset, length); length UINT32_MAX = absent
  size_t model_count_ = 0;
  bool merges_use_byte_tokens_ = false;
};

}  // namespace

void TokenStringIndex::reset(size_t expected_entries) {
  slots_.assign(table_capacity(expected_entries), Slot{-1, 0, {}});
  mask_ = slots_.size() - 1;
}

bool TokenStringIndex::matches(const Slot& s, std::string_view text, const std::string& arena,
                               const std::vector<uint32_t>& offsets) {
  if (s.length != std::min<size_t>(text.size(), 255)) return false;
  if (std::memcmp(s.head, text.data(), std::min(text.size(), kInlineBytes)) != 0) return false;
  if (text.size() <= kInlineBytes) return true;
  return std::string_view(arena).substr(offsets[s.id], offsets[s.id + 1] - offsets[s.id]) == text;
}

TokenId TokenStringIndex::insert_hashed(std::string_view text, size_t hash, TokenId id, const std::string& arena,
                                        const std::vector<uint32_t>& offsets) {
  for (size_t slot = hash & mask_;; slot = (slot + 1) & mask_) {
    Slot& s = slots_[slot];
    if (s.id < 0) {
      s.id = id;
      s.length = uint8_t(std::min<size_t>(text.size(), 255));
      std::memcpy(s.head, text.data(), std::min(text.size(), kInlineBytes));
      return id;
    }
    if (matches(s, text, arena, offsets)) return s.id;
  }
}

size_t TokenStringIndex::hash(std::string_view text) { return hash_bytes(text); }

TokenId TokenStringIndex::find_hashed(std::string_view text, size_t hash, const std::string& arena,
                                      const std::vector<uint32_t>& offsets) const {
  if (slots_.empty()) return -1;
  for (size_t slot = hash & mask_;; slot = (slot + 1) & mask_) {
    const Slot& s = slots_[slot];
    if (s.id < 0) return -1;
    if (matches(s, text, arena, offsets)) return s.id;
  }
}

void MergeTable::reset(size_t expected_entries) {
  entries_.assign(table_capacity(expected_entries), Entry{});
  mask_ = entries_.size() - 1;
  size_ = 0;
}

void MergeTable::insert_or_assign(TokenId left, TokenId right, MergeResult result) {
  if ((size_ + 1) * 2 > entries_.size()) {
    std::vector<Entry> old = std::move(entries_);
    reset(std::max<size_t>(old.size(), 16));
    for (const Entry& e : old)
      if (e.key != kEmpty) insert_or_assign(TokenId(e.key >> 32), TokenId(uint32_t(e.key)), e.result);
  }
  uint64_t key = pack(left, right);
  for (size_t slot = hash(key) & mask_;; slot = (slot + 1) & mask_) {
    Entry& e = entries_[slot];
    if (e.key == key) {
      e.result = result;
      return;
    }
    if (e.key == kEmpty) {
      e.key = key;
      e.result = result;
      ++size_;
      return;
    }
  }
}

void AddedTokenTrie::build(const std::vector<AddedToken>& tokens) {
  nodes_.assign(1, Node{});
  std::fill(std::begin(first_byte_), std::end(first_byte_), false);
  for (const AddedToken& token : tokens) {
    int32_t node = 0;
    for (unsigned char c : token.content) {
      int32_t next = -1;
      for (auto& [byte, child] : nodes_[node].children)
        if (byte == c) next = child;
      if (next < 0) {
        next = int32_t(nodes_.size());
        nodes_[node].children.emplace_back(c, next);
        nodes_.emplace_back();
      }
      node = next;
    }
    nodes_[node].token = token.id;
    first_byte_[uint8_t(token.content[0])] = true;
  }
}

size_t AddedTokenTrie::longest_match(std::string_view text, size_t pos, TokenId& id) const {
  size_t best = 0;
  int32_t node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    int32_t next = -1;
    for (auto& [byte, child] : nodes_[node].children)
      if (byte == uint8_t(text[i])) next = child;
    if (next < 0) break;
    node = next;
    if (nodes_[node].token >= 0) {
      best = i + 1 - pos;
      id = nodes_[node].token;
    }
  }
  return best;
}

std::unique_ptr<Tokenizer::Impl> load_tokenizer_json(std::string_view json_text, const std::string& source) {
  return Loader(json_text, source).load();
}

}  // namespace dg::text
