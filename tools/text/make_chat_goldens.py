#!/usr/bin/env python3
"""Renders tests/fixtures/chat/conversations.json with the official DiffusionGemma chat template through jinja2,
configured the way HF transformers' apply_chat_template configures it, and writes tests/fixtures/chat/goldens.json.
tests/test_chat_template.cpp then requires the C++ renderer to reproduce every golden byte for byte.

Deterministic: same inputs, same output bytes. Needs only python3 + jinja2 (Debian python3-jinja2).

    python3 tools/text/make_chat_goldens.py            # rewrite goldens.json
    python3 tools/text/make_chat_goldens.py --check    # exit 1 if goldens.json is stale

Case fields (conversations.json is a list):
  name                    unique id
  messages                OpenAI-style messages
  tools                   optional tool declarations (omitted = HF's tools=None)
  enable_thinking         optional bool, default false
  add_generation_prompt   optional bool, default true (the C++ default; HF's default is false)
  parse_string_arguments  optional bool, default true: JSON-string tool-call arguments that decode to an object are
                          replaced by that object before rendering, as ChatRenderOptions::parse_string_arguments does
  expect_error            optional bool: the template must raise on this input (the C++ renderer must throw)
"""
import argparse
import copy
import hashlib
import json
import os
import sys
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "chat")
TEMPLATE_MD5 = "8c34cf93c7a7815b3fdb300a009c4c17"


def compile_like_transformers(template_text):
    """transformers.utils.chat_template_utils._compile_jinja_template, minus the AssistantTracker extension
    (it only adds the {% generation %} tag, which this template does not use)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template_text)


def decode_string_arguments(messages):
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("tool_calls"), list):
            continue
        for call in message["tool_calls"]:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    decoded = json.loads(function["arguments"])
                except ValueError:
                    continue
                if isinstance(decoded, dict):
                    function["arguments"] = decoded


def render_case(template, case):
    messages = copy.deepcopy(case["messages"])
    if case.get("parse_string_arguments", True):
        decode_string_arguments(messages)
    kwargs = dict(
        messages=messages,
        tools=case.get("tools"),
        documents=None,
        add_generation_prompt=case.get("add_generation_prompt", True),
        enable_thinking=case.get("enable_thinking", False),
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    try:
        return {"rendered": template.render(**kwargs)}
    except Exception as e:  # the template's own failures (TypeError, UndefinedError, TemplateError)
        return {"error": f"{type(e).__name__}: {e}"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="fail if goldens.json differs from a fresh render")
    args = parser.parse_args()

    with open(os.path.join(FIXTURES, "chat_template.jinja"), "rb") as f:
        template_bytes = f.read()
    if hashlib.md5(template_bytes).hexdigest() != TEMPLATE_MD5:
        sys.exit("chat_template.jinja is not the DiffusionGemma template (md5 %s expected)" % TEMPLATE_MD5)
    template = compile_like_transformers(template_bytes.decode("utf-8"))

    with open(os.path.join(FIXTURES, "conversations.json"), encoding="utf-8") as f:
        cases = json.load(f)

    names = set()
    goldens = []
    problems = []
    for case in cases:
        name = case["name"]
        if name in names:
            problems.append(f"duplicate case name {name}")
        names.add(name)
        result = render_case(template, case)
        if case.get("expect_error", False) != ("error" in result):
            problems.append(f"{name}: expect_error={case.get('expect_error', False)} but got {result}")
        goldens.append({"name": name, **result})
    if problems:
        sys.exit("\n".join(problems))

    out = {
        "generator": "tools/text/make_chat_goldens.py",
        "jinja2": jinja2.__version__,
        "template_md5": TEMPLATE_MD5,
        "cases": goldens,
    }
    text = json.dumps(out, ensure_ascii=False, indent=1) + "\n"
    path = os.path.join(FIXTURES, "goldens.json")
    if args.check:
        with open(path, encoding="utf-8") as f:
            if f.read() != text:
                sys.exit("goldens.json is stale: run python3 tools/text/make_chat_goldens.py")
        print(f"goldens.json up to date ({len(goldens)} cases)")
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {path}: {len(goldens)} cases, {sum('error' in g for g in goldens)} expected errors")


if __name__ == "__main__":
    main()
