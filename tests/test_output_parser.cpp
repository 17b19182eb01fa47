// Streaming output parser: round trips through the chat renderer, chunk-boundary invariance, malformed output, fuzz.
#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <sstream>

#include "text/chat_template.h"
#include "text/output_parser.h"
#include "util/error.h"

namespace {

using Json = nlohmann::ordered_json;
using dg::text::OutputEvent;
using dg::text::OutputParser;
using dg::text::OutputParserOptions;
using Kind = OutputEvent::Kind;

// Adjacent deltas of one kind merged: the form in which any two chunkings of the same text must agree.
std::vector<OutputEvent> coalesce(const std::vector<OutputEvent>& events) {
  std::vector<OutputEvent> out;
  for (const auto& e : events) {
    const bool text = e.kind == Kind::kContent || e.kind == Kind::kReasoning;
    if (text && !out.empty() && out.back().kind == e.kind)
      out.back().text += e.text;
    else
      out.push_back(e);
  }
  return out;
}

std::string describe(const std::vector<OutputEvent>& events) {
  std::string s;
  for (const auto& e : events) {
    switch (e.kind) {
      case Kind::kContent: s += "C[" + e.text + "]"; break;
      case Kind::kReasoning: s += "R[" + e.text + "]"; break;
      case Kind::kToolCall:
        s += "T" + std::to_string(e.tool_index) + "[" + e.tool_call.name + " " + e.tool_call.arguments.dump() + "]";
        break;
      case Kind::kError: s += "E[" + e.text + " | " + e.raw + "]"; break;
    }
  }
  return s;
}

std::vector<OutputEvent> feed_chunks(std::string_view text, const std::vector<size_t>& cuts,
                                     OutputParserOptions options = {}) {
  OutputParser parser(options);
  std::vector<OutputEvent> events;
  size_t start = 0;
  for (size_t cut : cuts) {
    for (auto& e : parser.feed(text.substr(start, cut - start))) events.push_back(std::move(e));
    start = cut;
  }
  for (auto& e : parser.feed(text.substr(start))) events.push_back(std::move(e));
  for (auto& e : parser.finish()) events.push_back(std::move(e));
  return coalesce(events);
}

// A string is representable in the call grammar unless it contains the delimiters that end it early.
bool representable(const Json& v) {
  static const std::vector<std::string> kBreakers = {"<|\"|>", "<tool_call|>", "<|tool_call>", "<turn|>",
                                                     "<|tool_response>"};
  auto clean = [&](const std::string& s) {
    for (const auto& b : kBreakers)
      if (s.find(b) != std::string::npos) return false;
    return true;
  };
  if (v.is_string()) return clean(v.get<std::string>());
  if (v.is_array()) {
    for (const auto& x : v)
      if (!representable(x)) return false;
  }
  if (v.is_object()) {
    for (auto it = v.begin(); it != v.end(); ++it) {
      const std::string& key = it.key();
      if (key.empty() || !clean(key) || key.find_first_of(":,{}[]") != std::string::npos ||
          std::isspace(static_cast<unsigned char>(key.front())) || std::isspace(static_cast<unsigned char>(key.back())))
        return false;
      if (!representable(it.value())) return false;
    }
  }
  return true;
}

// The model-turn text the renderer writes for a single assistant message (reasoning + tool calls).
std::string render_model_turn(const Json& assistant) {
  Json messages = Json::array({Json{{"role", "user"}, {"content", "q"}}, assistant});
  dg::text::ChatRenderOptions options;
  options.add_generation_prompt = false;
  const std::string prompt = dg::text::render_chat(messages, Json(), options);
  const std::string open = "<|turn>model\n";
  return prompt.substr(prompt.rfind(open) + open.size());
}

struct RoundTripCase {
  std::string text;
  std::string reasoning;
  std::vector<dg::text::ToolCall> calls;
};

std::vector<RoundTripCase> golden_round_trips() {
  std::ifstream in(std::string(DIFFGEMMA_FIXTURES_DIR) + "/chat/conversations.json");
  std::stringstream buffer;
  buffer << in.rdbuf();
  std::vector<RoundTripCase> cases;
  for (const Json& conversation : Json::parse(buffer.str())) {
    if (conversation.value("expect_error", false)) continue;
    for (const Json& message : conversation["messages"]) {
      if (!message.is_object() || message.value("role", "") != "assistant") continue;
      if (!message.contains("tool_calls") || !message["tool_calls"].is_array() || message["tool_calls"].empty())
        continue;
      Json assistant = {{"role", "assistant"}, {"tool_calls", Json::array()}};
      RoundTripCase c;
      bool ok = true;
      for (const Json& call : message["tool_calls"]) {
        Json arguments = call["function"].contains("arguments") ? call["function"]["arguments"] : Json();
        if (arguments.is_string()) arguments = Json::parse(arguments.get<std::string>(), nullptr, false);
        if (arguments.is_null()) arguments = Json::object();
        if (!arguments.is_object() || !representable(arguments)) ok = false;
        assistant["tool_calls"].push_back({{"function", {{"name", call["function"]["name"]}, {"arguments", arguments}}}});
        c.calls.push_back({call["function"]["name"].get<std::string>(), arguments});
      }
      for (const char* key : {"reasoning", "reasoning_content"}) {
        if (c.reasoning.empty() && message.contains(key) && message[key].is_string()) {
          c.reasoning = message[key].get<std::string>();
          assistant["reasoning_content"] = c.reasoning;
        }
      }
      if (!ok) continue;
      c.text = render_model_turn(assistant);
      cases.push_back(std::move(c));
    }
  }
  return cases;
}

TEST(OutputParser, GoldenToolCallsAndReasoningRoundTrip) {
  const auto cases = golden_round_trips();
  size_t calls = 0, with_reasoning = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text);
    const auto parsed = dg::text::parse_output(c.text);
    EXPECT_TRUE(parsed.errors.empty());
    EXPECT_EQ(parsed.content, "");
    EXPECT_EQ(parsed.reasoning, c.reasoning);
    ASSERT_EQ(parsed.tool_calls.size(), c.calls.size());
    for (size_t i = 0; i < c.calls.size(); ++i) {
      EXPECT_EQ(parsed.tool_calls[i].name, c.calls[i].name);
      // Key order differs (the template dictsorts); compare as unordered JSON.
      EXPECT_EQ(nlohmann::json::parse(parsed.tool_calls[i].arguments.dump()),
                nlohmann::json::parse(c.calls[i].arguments.dump()));
      ++calls;
    }
    if (!c.reasoning.empty()) ++with_reasoning;
  }
  EXPECT_GE(calls, 20u);
  EXPECT_GE(with_reasoning, 4u);
}

TEST(OutputParser, GenerationShapes) {
  auto p = dg::text::parse_output("<|channel>thought\nLet me think.\nDone.\n<channel|>The answer is 4.<turn|>ignored");
  EXPECT_EQ(p.reasoning, "Let me think.\nDone.");
  EXPECT_EQ(p.content, "The answer is 4.");
  EXPECT_TRUE(p.errors.empty());

  p = dg::text::parse_output("Plain answer with <b>html</b> and a < sign.<turn|>");
  EXPECT_EQ(p.content, "Plain answer with <b>html</b> and a < sign.");

  p = dg::text::parse_output("<|channel>thought\nneed data<|tool_call>call:get_weather{location:<|\"|>Oslo<|\"|>}"
                             "<tool_call|><|tool_response>");
  EXPECT_EQ(p.reasoning, "need data");
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].arguments, Json({{"location", "Oslo"}}));

  p = dg::text::parse_output("still thinking\n<channel|>answer", {.start_in_reasoning = true});
  EXPECT_EQ(p.reasoning, "still thinking");
  EXPECT_EQ(p.content, "answer");

  p = dg::text::parse_output("<|channel><channel|>after empty channel");
  EXPECT_EQ(p.reasoning, "");
  EXPECT_EQ(p.content, "after empty channel");

  p = dg::text::parse_output("stray close<channel|> dropped");
  EXPECT_EQ(p.content, "stray close dropped");
}

TEST(OutputParser, ArgumentGrammar) {
  auto call = dg::text::parse_tool_call(
      "call:plan{a:1,b:-2.5,c:1e-05,d:1e+16,e:true,f:false,g:None,h:null,i:<|\"|>x, y: {z}<|\"|>,"
      "j:[1,<|\"|>two<|\"|>,[],{}],k:{n:{m:[{o:0}]}},<|\"|>quoted key<|\"|>:3,big:12345678901234567890}");
  EXPECT_EQ(call.name, "plan");
  EXPECT_EQ(call.arguments.dump(),
            R"({"a":1,"b":-2.5,"c":1e-05,"d":1e+16,"e":true,"f":false,"g":null,"h":null,"i":"x, y: {z}",)"
            R"("j":[1,"two",[],{}],"k":{"n":{"m":[{"o":0}]}},"quoted key":3,"big":12345678901234567890})");
  EXPECT_TRUE(call.arguments["a"].is_number_integer());
  EXPECT_TRUE(call.arguments["c"].is_number_float());

  // Tolerated model deviations: whitespace between tokens, trailing commas, unquoted strings.
  call = dg::text::parse_tool_call(" call:f{ a : 1 , b : [ 1 , 2 , ] , c : Paris , }");
  EXPECT_EQ(call.arguments.dump(), R"({"a":1,"b":[1,2],"c":"Paris"})");
  EXPECT_EQ(dg::text::parse_tool_call("call:ns.tool-v2{}").name, "ns.tool-v2");
}

TEST(OutputParser, MalformedCallsAreErrorEvents) {
  struct Bad {
    std::string text;
    std::string error_part;
  };
  const std::vector<Bad> bad = {
      {"<|tool_call>call:f{a:<|\"|>x}<tool_call|>", "unterminated"},
      {"<|tool_call>call:{}<tool_call|>", "invalid function name"},
      {"<|tool_call>get_weather{}<tool_call|>", "expected 'call:"},
      {"<|tool_call>call:f{a:1}}<tool_call|>", "after the closing"},
      {"<|tool_call>call:f{a}<tool_call|>", "expected 'key:'"},
      {"<|tool_call>call:f{a:}<tool_call|>", "missing value"},
      {"<|tool_call>call:f{a:[1,2}<tool_call|>", "expected ','"},
      {"<|tool_call>call:f<tool_call|>", "no '{'"},
      {"<|tool_call>call:f{a:1", "ended inside a tool call"},
      {"<|tool_call>call:f{a:1<turn|>", "cut off by <turn|>"},
      {"<|tool_call>call:f{a:" + std::string(300, '[') + "<tool_call|>", "nest deeper"},
      {"<|channel>" + std::string(60, 'x'), "channel header"},
      {"<|channel>thou", "inside a channel header"},
      {"text<tool_call|>", "without a preceding"},
  };
  for (const auto& [text, error_part] : bad) {
    SCOPED_TRACE(text);
    std::vector<OutputEvent> events;
    ASSERT_NO_THROW(events = dg::text::parse_output_events(text));
    const auto parsed = dg::text::collect_events(events);
    ASSERT_EQ(parsed.errors.size(), 1u) << describe(events);
    EXPECT_NE(parsed.errors[0].find(error_part), std::string::npos) << parsed.errors[0];
    EXPECT_TRUE(parsed.tool_calls.empty());
  }

  // A truncated call followed by a new one: the first is reported, the second still parses.
  auto parsed = dg::text::parse_output("<|tool_call>call:f{a:1<|tool_call>call:g{b:2}<tool_call|>after");
  ASSERT_EQ(parsed.errors.size(), 1u);
  ASSERT_EQ(parsed.tool_calls.size(), 1u);
  EXPECT_EQ(parsed.tool_calls[0].name, "g");
  EXPECT_EQ(parsed.content, "after");

  // The payload of an unfinished call survives in the error's raw text for the caller to surface.
  const auto events = dg::text::parse_output_events("<|tool_call>call:f{a:<|\"|>par");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].raw, "<|tool_call>call:f{a:<|\"|>par");
}

TEST(OutputParser, TurnEndStopsParsing) {
  OutputParser parser;
  auto events = parser.feed("answer<tu");
  EXPECT_EQ(describe(events), "C[answer]");
  EXPECT_FALSE(parser.done());
  events = parser.feed("rn|>more text<|tool_call>call:f{}<tool_call|>");
  EXPECT_TRUE(events.empty());
  EXPECT_TRUE(parser.done());
  EXPECT_TRUE(parser.finish().empty());

  const auto parsed = dg::text::parse_output("<|tool_call>call:f{}<tool_call|><|tool_response>response:f{}");
  EXPECT_EQ(parsed.tool_calls.size(), 1u);
  EXPECT_EQ(parsed.content, "");
}

TEST(OutputParser, OverlongToolCallIsDiscarded) {
  OutputParserOptions options{.max_tool_call_bytes = 64};
  const std::string text = "a<|tool_call>call:f{x:<|\"|>" + std::string(200, 'y') + "<|\"|>}<tool_call|>b" +
                           "<|tool_call>call:g{}<tool_call|>";
  const auto parsed = dg::text::parse_output(text, options);
  ASSERT_EQ(parsed.errors.size(), 1u);
  EXPECT_NE(parsed.errors[0].find("longer than 64"), std::string::npos);
  EXPECT_EQ(parsed.content, "ab");
  ASSERT_EQ(parsed.tool_calls.size(), 1u);
  EXPECT_EQ(parsed.tool_calls[0].name, "g");
}

std::vector<std::string> sample_outputs() {
  std::vector<std::string> samples;
  for (const auto& c : golden_round_trips()) samples.push_back(c.text);
  samples.push_back("<|channel>thought\nLet me think.\n\n<channel|>The answer\nis 4.<turn|>tail");
  samples.push_back("Answer <with> <|turn brackets and \n newlines <channel <|channel\n");
  samples.push_back("<|channel>thought\nplan<|tool_call>call:f{a:1}<tool_call|>then<|tool_call>call:g{b:[<|\"|>x<|\"|>]}"
                    "<tool_call|><|tool_response>");
  samples.push_back("<|tool_call>call:f{a:1<|tool_call>call:g{}<tool_call|>x<tool_call|>y");
  samples.push_back("<|channel>" + std::string(40, 'h') + "\nreasoning?<channel|>content");
  samples.push_back("<|channel>thought\nunterminated reasoning \n");
  samples.push_back("<|tool_call>call:f{a:<|\"|>unterminated");
  samples.push_back("text ending in a partial marker <|tool_ca");
  return samples;
}

TEST(OutputParser, EverySplitPointGivesTheSameEvents) {
  for (const std::string& text : sample_outputs()) {
    SCOPED_TRACE(text);
    const auto whole = describe(feed_chunks(text, {}));
    for (size_t cut = 0; cut <= text.size(); ++cut) ASSERT_EQ(describe(feed_chunks(text, {cut})), whole) << cut;
    std::vector<size_t> every_byte;
    for (size_t i = 1; i < text.size(); ++i) every_byte.push_back(i);
    EXPECT_EQ(describe(feed_chunks(text, every_byte)), whole);
  }
}

TEST(OutputParser, FuzzedOutputNeverCrashesAndStaysSplitInvariant) {
  const auto seeds = sample_outputs();
  const std::vector<std::string> fragments = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<turn|>",
                                              "<|tool_response>", "<|\"|>", "call:", "{", "}", "[", "]", ",", ":",
                                              "\n", "thought\n", "None", "-1.5e+3", "true", "\xff", "\xe6\x97"};
  std::mt19937 rng(20240607);
  auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  size_t tool_calls = 0, errors = 0;
  for (int iteration = 0; iteration < 4000; ++iteration) {
    std::string text = seeds[pick(seeds.size())];
    for (int m = 0, mutations = 1 + static_cast<int>(pick(6)); m < mutations; ++m) {
      const size_t at = text.empty() ? 0 : pick(text.size() + 1);
      switch (pick(5)) {
        case 0: text.insert(at, fragments[pick(fragments.size())]); break;
        case 1: text.erase(at, pick(8)); break;
        case 2: text.insert(at, 1, static_cast<char>(pick(256))); break;
        case 3: text.resize(at); break;
        case 4: text.insert(at, text.substr(at / 2, pick(16))); break;
      }
    }
    OutputParserOptions options;
    if (iteration % 7 == 0) options.max_tool_call_bytes = 16;
    if (iteration % 5 == 0) options.start_in_reasoning = true;
    std::vector<size_t> cuts;
    for (size_t i = 0, n = pick(5); i < n && !text.empty(); ++i) cuts.push_back(pick(text.size() + 1));
    std::sort(cuts.begin(), cuts.end());
    std::vector<OutputEvent> whole, chunked;
    ASSERT_NO_THROW(whole = feed_chunks(text, {}, options)) << text;
    ASSERT_NO_THROW(chunked = feed_chunks(text, cuts, options)) << text;
    ASSERT_EQ(describe(chunked), describe(whole)) << text;
    for (const auto& e : whole) {
      tool_calls += e.kind == Kind::kToolCall;
      errors += e.kind == Kind::kError;
    }
    try {
      dg::text::parse_tool_call(text);
    } catch (const dg::Error&) {
    }
  }
  // The mutations must exercise both outcomes, or the fuzz proves nothing.
  EXPECT_GT(tool_calls, 500u);
  EXPECT_GT(errors, 500u);
}

}  // namespace
