#!/usr/bin/env python3
"""gen_data_format_fixture.py - a byte-level BPE tokenizer whose ids fit `meshlm init --preset tiny`.

PURPOSE
    tests/cli/test_data_formats.sh trains and scores text and prompt/completion
    JSONL with a model directory that holds a tokenizer.json. The `tiny` preset
    has vocab_size 256, below the ids of the tokenizer fixtures of
    tests/fixtures/tokenizer (about 1500 and 49152), so this script trains a
    Llama 3 style byte-level BPE with 256 ids in all (printable ASCII, \\t, \\n
    and \\r as its alphabet, 2 special tokens) and records golden ids of the
    texts the test uses, from `tokenizers`' Tokenizer.encode.

    CI NEVER RUNS THIS SCRIPT: run it by hand in a venv with
    `pip install tokenizers`; its output is committed.

USAGE
    /work/venv/bin/python tools/gen_data_format_fixture.py [--out tests/fixtures/data_formats]

OUTPUT
    tokenizer.json         BPE over ByteLevel(add_prefix_space false, use_regex true), ByteLevel
                           decoder, TemplateProcessing "<|begin_of_text|> $A"; ids 0..255
    tokenizer_config.json  bos_token <|begin_of_text|>, eos_token <|end_of_text|>
    cases.json             {"tokenizers_version", "bos", "eos", "cases": [one case per line:
                           {"text": str, "add_special": bool, "ids": [int]}]}
"""
import argparse
import json
import os
import string

import tokenizers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The texts of tests/cli/test_data_formats.sh (plain ASCII, no quote or backslash, so the
# shell can grep for them).
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "meshlm trains and scores decoder language models.",
    "Question: what is two plus two?",
    " Answer: four.",
    "Name a colour of the sky.",
    " Blue, on a clear day.",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "data_formats"))
    out = ap.parse_args().out
    os.makedirs(out, exist_ok=True)
    byte_map = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte characters, unordered
    bytes_to_unicode = {}
    n = 0
    for b in range(256):  # GPT-2's bytes_to_unicode
        if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255:
            bytes_to_unicode[b] = chr(b)
        else:
            bytes_to_unicode[b] = chr(256 + n)
            n += 1
    assert set(bytes_to_unicode.values()) == set(byte_map)
    alphabet = [bytes_to_unicode[ord(c)] for c in string.printable]  # printable ASCII + \t\n\r\v\f

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(vocab_size=256, show_progress=False, initial_alphabet=alphabet,
                                  special_tokens=[AddedToken(s, special=True, normalized=False)
                                                  for s in specials])
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        corpus = "".join(c for c in f.read() if c in string.printable)
    tok.train_from_iterator([corpus] + TEXTS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[(specials[0], tok.token_to_id(specials[0]))])
    assert tok.get_vocab_size() <= 256, tok.get_vocab_size()
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": specials[0], "eos_token": specials[1]}, f, indent=2)
        f.write("\n")
    cases = []
    for text in TEXTS:
        for add_special in (True, False):
            ids = tok.encode(text, add_special_tokens=add_special).ids
            assert max(ids) < 256
            cases.append(json.dumps({"text": text, "add_special": add_special, "ids": ids}))
    with open(os.path.join(out, "cases.json"), "w") as f:
        f.write('{"tokenizers_version": "%s", "bos": %d, "eos": %d, "cases": [\n'
                % (tokenizers.__version__, tok.token_to_id(specials[0]),
                   tok.token_to_id(specials[1])))
        f.write(",\n".join(cases))
        f.write("\n]}\n")


if __name__ == "__main__":
    main()
