#!/usr/bin/env python3
"""gen_chat_fixtures.py - transformers' apply_chat_template ids and assistant masks of a few chats.

PURPOSE
    meshlm renders {"messages": [...]} records with the model's chat template (src/data/data_chat.h,
    the Jinja interpreter src/template) and trains on the assistant turns only. This script records
    what transformers makes of the same conversations, so that tests/unit/test_chat.c and
    tests/cli/test_chat.sh compare meshlm's ids and targets with it:
      input_ids        tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                       return_dict=True)["input_ids"] (the rendered chat encoded without special
                       tokens);
      assistant_masks  with a template that has {% generation %} blocks: the same call's
                       return_assistant_tokens_mask=True output; otherwise the prefix rule of
                       data_chat.h in Python: for each assistant message i, the characters
                       render(messages[:i+1]) adds after render(messages[:i],
                       add_generation_prompt=True), mapped onto the whole chat's tokens through
                       char_to_token exactly as return_assistant_tokens_mask maps its spans;
      text             the rendered chat (tokenize=False).
    Templates (paths under tests/fixtures): jinja/templates/smollm2.jinja and gemma3.jinja are the
    real chat templates of SmolLM2-135M-Instruct and Gemma 3 270M (their GGUF files'
    tokenizer.chat_template metadata, tools/gen_jinja_fixtures.py); chat/smollm2_generation.jinja
    is SmolLM2's with {% generation %} around the assistant turns (content and <|im_end|>);
    chat/two_spaces.jinja ends its generation prompt with two spaces, so that the assistant
    text starts inside a token (" Hello" after a lone " ": the pre-tokenizer cuts the prompt's
    text alone otherwise). Tokenizers: tests/fixtures/tokenizer/smollm2 (SmolLM2's real
    tokenizer) and tests/fixtures/data_formats (the 256-id tokenizer that fits `meshlm init
    --preset tiny`, ASCII chats only), each with the template as chat_template.jinja.

    CI NEVER RUNS THIS SCRIPT: run it by hand where transformers is installed (5.23 wrote the
    committed output); its output is committed.

USAGE
    python3 tools/gen_chat_fixtures.py [--out tests/fixtures/chat/cases.json]

OUTPUT
    cases.json  {"transformers_version", "cases": [{"name", "tokenizer" (a fixture directory
                under tests/fixtures), "template" (a file under tests/fixtures), "messages",
                "tools" (optional), "text", "input_ids", "assistant_masks"}]}, one case per line
"""
import argparse
import json
import os
import shutil
import tempfile

import transformers
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

# ASCII only, no quote or backslash: tests/cli/test_chat.sh writes some of them with printf.
ASCII_CHATS = {
    "system_user_assistant": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Question: what is two plus two?"},
        {"role": "assistant", "content": "Answer: four."}],
    "two_turns": [
        {"role": "user", "content": "Name a colour of the sky."},
        {"role": "assistant", "content": "Blue, on a clear day."},
        {"role": "user", "content": "And at night?"},
        {"role": "assistant", "content": "Black, with stars."}],
}
UNICODE_CHATS = {
    "unicode": [
        {"role": "user", "content": "Traduis: the caf\u00e9 is open \u2014 \u65e5\u672c\u8a9e?"},
        {"role": "assistant", "content": "Le caf\u00e9 est ouvert \U0001F600\n\nVoil\u00e0."}],
    "spaces_and_tools": [
        {"role": "user", "content": "  Weather in Paris?  "},
        {"role": "assistant", "content": "  Sunny.\n"}],
}
PARTS_CHAT = {
    "text_parts": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hello "},
                                     {"type": "text", "text": "there."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]}],
}

# (tokenizer fixture, template, chats)
SMOLLM2 = "jinja/templates/smollm2.jinja"
GEMMA3 = "jinja/templates/gemma3.jinja"
SMOLLM2_GEN = "chat/smollm2_generation.jinja"
TWO_SPACES = "chat/two_spaces.jinja"
SETS = [
    ("tokenizer/smollm2", SMOLLM2, {**ASCII_CHATS, **UNICODE_CHATS}),
    ("tokenizer/smollm2", SMOLLM2_GEN, {**ASCII_CHATS, **UNICODE_CHATS}),
    ("tokenizer/smollm2", GEMMA3, {**ASCII_CHATS, **UNICODE_CHATS, **PARTS_CHAT}),
    ("tokenizer/smollm2", TWO_SPACES, {**ASCII_CHATS, **UNICODE_CHATS}),
    ("data_formats", SMOLLM2, ASCII_CHATS),
    ("data_formats", SMOLLM2_GEN, ASCII_CHATS),
]


def model_dir(tok_fixture, template):
    d = tempfile.mkdtemp()
    src = os.path.join(FIX, tok_fixture)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, f), d)
    shutil.copy(os.path.join(FIX, template), os.path.join(d, "chat_template.jinja"))
    return d


def prefix_mask(tok, messages, tools, enc):
    """data_chat.h's prefix rule, spans mapped as return_assistant_tokens_mask maps them."""
    full = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    mask = [0] * len(enc["input_ids"])
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], tools=tools, tokenize=False,
                                         add_generation_prompt=True)
        upto = tok.apply_chat_template(messages[:i + 1], tools=tools, tokenize=False)
        assert upto.startswith(before) and full.startswith(upto), (i, before, upto)
        start, end = len(before), len(upto)  # characters
        if end <= start:
            continue
        s, e = enc.char_to_token(start), enc.char_to_token(end - 1)
        for t in range(s, e + 1 if e is not None else len(mask)):
            mask[t] = 1
    return mask


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(FIX, "chat", "cases.json"))
    out = ap.parse_args().out
    cases = []
    for tok_fixture, template, chats in SETS:
        d = model_dir(tok_fixture, template)
        tok = AutoTokenizer.from_pretrained(d)
        generation = "{% generation %}" in open(os.path.join(FIX, template)).read()
        for name, messages in chats.items():
            tools = TOOLS if name == "spaces_and_tools" else None
            text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
            enc = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=generation)
            ids = list(enc["input_ids"])
            assert ids == tok(text, add_special_tokens=False)["input_ids"]
            if generation:
                mask = list(enc["assistant_masks"])
            else:
                mask = prefix_mask(tok, messages, tools, tok(text, add_special_tokens=False))
            case = {"name": name, "tokenizer": tok_fixture, "template": template,
                    "messages": messages}
            if tools:
                case["tools"] = tools
            case.update({"text": text, "input_ids": ids, "assistant_masks": mask})
            cases.append(case)
        shutil.rmtree(d)
    with open(out, "w", encoding="utf-8") as f:
        f.write('{"transformers_version": "%s", "cases": [\n' % transformers.__version__)
        f.write(",\n".join(json.dumps(c, ensure_ascii=False) for c in cases))
        f.write("\n]}\n")
    print("wrote %d cases to %s" % (len(cases), out))


if __name__ == "__main__":
    main()
