/* The lexer: template data and the tokens inside {{ }}, {% %}, with
 * Jinja2's whitespace control as transformers configures it (ast.h).
 *
 * Jinja2 (lexer.py) with trim_blocks and lstrip_blocks:
 *  - "-" after a tag's opening ({%- {{- {#-) strips all whitespace before
 *    it; "-" before its end (-%} -}} -#}) all whitespace after it;
 *  - trim_blocks: the one newline right after %} or #} goes (not after }},
 *    not after +%});
 *  - lstrip_blocks: spaces and tabs from the start of a line up to {% or
 *    {# go (not before {{, not after {%+);
 *  - {% raw %}...{% endraw %} is data;
 *  - inside a tag, its end is recognised only outside brackets. */
#include <ctype.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/status.h"
#include "template/ast.h"
#include "template/text.h"

typedef struct lx {
  jarena *a;
  const char *origin, *src;
  size_t len;
  jtok *t;
  size_t n, cap;
  /* line of `lpos` and where that line starts: positions only move forward */
  size_t lpos, lstart;
  int line;
} lx;

static void where(lx *x, size_t off, int *line, int *col) {
  if (off < x->lpos) { /* a position before the cursor: count from the start */
    x->lpos = 0;
    x->lstart = 0;
    x->line = 1;
  }
  for (; x->lpos < off; x->lpos++)
    if (x->src[x->lpos] == '\n') {
      x->line++;
      x->lstart = x->lpos + 1;
    }
  *line = x->line;
  *col = (int)(off - x->lstart) + 1;
}

static int fail(lx *x, size_t off, const char *fmt, const char *arg) {
  int line, col;
  where(x, off, &line, &col);
  char msg[256];
  snprintf(msg, sizeof msg, fmt, arg);
  return ml_err("%s:%d:%d: %s", x->origin, line, col, msg);
}

static int oom(lx *x, size_t off) {
  return fail(x, off, "%s", "template too large: out of the parse's memory bound");
}

static int push(lx *x, jtok_kind k, size_t off, const char *s, size_t len) {
  if (x->n == x->cap) {
    size_t nc = x->cap ? x->cap * 2 : 64;
    jtok *p = ja_alloc(x->a, nc * sizeof *p);
    if (!p) return oom(x, off);
    if (x->n) memcpy(p, x->t, x->n * sizeof *p);
    x->t = p;
    x->cap = nc;
  }
  jtok *t = &x->t[x->n++];
  t->kind = k;
  where(x, off, &t->line, &t->col);
  if (s) {
    jstr *c = jstr_new(x->a, s, len);
    if (!c) return oom(x, off);
    t->s = c->s;
    t->len = len;
  }
  return 0;
}

/* Past the whitespace (Python's \s, Unicode's included) from i. */
static size_t ws_fwd(const char *s, size_t len, size_t i) {
  while (i < len) {
    size_t n;
    if (!txt_space(txt_cp(s, len, i, &n))) break;
    i += n;
  }
  return i;
}

/* The start of the whitespace run that ends at e, not before lo; newlines
 * end the run unless nl. */
static size_t ws_back(const char *s, size_t lo, size_t e, bool nl) {
  while (e > lo) {
    size_t k = e - 1, n;
    while (k > lo && ((unsigned char)s[k] & 0xC0) == 0x80) k--;
    int32_t c = txt_cp(s, e, k, &n);
    if (!txt_space(c) || (!nl && c == '\n')) break;
    e = k;
  }
  return e;
}

/* The next "{{", "{%" or "{#" at or after pos, or len. */
static size_t next_tag(const char *s, size_t pos, size_t len) {
  for (size_t i = pos; i + 1 < len; i++)
    if (s[i] == '{' && (s[i + 1] == '{' || s[i + 1] == '%' || s[i + 1] == '#')) return i;
  return len;
}

/* Whether s[p..] is "{%" [-+]? ws* word ws* then "-%}", "+%}" or "%}": the
 * end (after "%}") in *end, the signs in *open_sign, *close_sign. */
static bool word_tag(const char *s, size_t p, size_t len, const char *word, size_t *end, char *open_sign,
                     char *close_sign) {
  size_t wl = strlen(word), q = p + 2;
  *open_sign = q < len && (s[q] == '-' || s[q] == '+') ? s[q++] : 0;
  q = ws_fwd(s, len, q);
  if (len - q < wl || memcmp(s + q, word, wl) != 0) return false;
  q += wl;
  q = ws_fwd(s, len, q);
  *close_sign = q < len && (s[q] == '-' || s[q] == '+') ? s[q++] : 0;
  if (len - q < 2 || s[q] != '%' || s[q + 1] != '}') return false;
  *end = q + 2;
  return true;
}

/* After a tag's end at pos: "-" strips the whitespace that follows,
 * trim_blocks one newline (after %} and #} without "+"). */
static size_t after_end(const char *s, size_t pos, size_t len, char sign, bool block) {
  if (sign == '-')
    pos = ws_fwd(s, len, pos);
  else if (sign != '+' && block && pos < len && s[pos] == '\n')
    pos++;
  return pos;
}

/* Python's unicode-escape of a string literal's body into out (same or
 * shorter length). */
static int unescape(lx *x, size_t off, const char *s, size_t n, char *out, size_t *outlen) {
  size_t o = 0;
  for (size_t i = 0; i < n; i++) {
    if (s[i] != '\\' || i + 1 == n) {
      out[o++] = s[i];
      continue;
    }
    char c = s[++i];
    const char *simple = strchr("\\'\"abfnrtv\n", c);
    if (simple && c) {
      static const char map[] = "\\'\"\a\b\f\n\r\t\v";
      if (c != '\n') out[o++] = map[simple - "\\'\"abfnrtv\n"];
      continue; /* backslash-newline: a line continuation */
    }
    unsigned long cp;
    int digits = c == 'x' ? 2 : c == 'u' ? 4 : c == 'U' ? 8 : 0;
    if (digits) {
      if (n - i - 1 < (size_t)digits) return fail(x, off, "%s", "a truncated \\x, \\u or \\U escape in a string");
      char hex[9] = {0};
      memcpy(hex, s + i + 1, (size_t)digits);
      char *e;
      cp = strtoul(hex, &e, 16);
      if (*e || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return fail(x, off, "%s", "an invalid \\x, \\u or \\U escape in a string");
      i += (size_t)digits;
    } else if (c >= '0' && c <= '7') {
      cp = 0;
      int k = 0;
      for (; k < 3 && i < n && s[i] >= '0' && s[i] <= '7'; k++, i++) cp = cp * 8 + (unsigned long)(s[i] - '0');
      i--;
    } else if (c == 'N') {
      return fail(x, off, "%s", "a \\N{...} escape in a string is not supported");
    } else { /* unknown escapes stay as written */
      out[o++] = '\\';
      out[o++] = c;
      continue;
    }
    /* UTF-8 of cp (never longer than the escape it replaces) */
    if (cp < 0x80) {
      out[o++] = (char)cp;
    } else if (cp < 0x800) {
      out[o++] = (char)(0xC0 | (cp >> 6));
      out[o++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out[o++] = (char)(0xE0 | (cp >> 12));
      out[o++] = (char)(0x80 | ((cp >> 6) & 0x3F));
      out[o++] = (char)(0x80 | (cp & 0x3F));
    } else {
      out[o++] = (char)(0xF0 | (cp >> 18));
      out[o++] = (char)(0x80 | ((cp >> 12) & 0x3F));
      out[o++] = (char)(0x80 | ((cp >> 6) & 0x3F));
      out[o++] = (char)(0x80 | (cp & 0x3F));
    }
  }
  *outlen = o;
  return 0;
}

static const char *const OPS[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
                                  ">",  "=",  "(",  ")",  "[",  "]",  "{", "}", ",", ".", ":", "|", ";"};

/* The tokens of one tag (opened at `open`) from *pos (after its opening
 * and sign) to its end; *pos is left after the end, *sign holds the end's
 * sign. */
static int lex_tag(lx *x, size_t open, size_t *pos, bool block, char *sign) {
  const char *s = x->src;
  size_t len = x->len, p = *pos;
  char stack[JINJA_MAX_DEPTH];
  int depth = 0;
  for (;;) {
    p = ws_fwd(s, len, p);
    if (p >= len) return fail(x, open, "%s", block ? "unterminated '{%': no '%}' before the end" : "unterminated '{{': no '}}' before the end");
    if (depth == 0) {
      const char *end = block ? "%}" : "}}";
      if ((s[p] == '-' || (block && s[p] == '+')) && p + 2 < len && memcmp(s + p + 1, end, 2) == 0) {
        *sign = s[p];
        *pos = p + 3;
        return push(x, block ? TK_BLOCK_END : TK_VAR_END, p, NULL, 0);
      }
      if (p + 1 < len && memcmp(s + p, end, 2) == 0) {
        *sign = 0;
        *pos = p + 2;
        return push(x, block ? TK_BLOCK_END : TK_VAR_END, p, NULL, 0);
      }
    }
    char c = s[p];
    size_t q = p;
    int base = c == '0' && p + 2 < len ? (s[p + 1] == 'x' || s[p + 1] == 'X'   ? 16
                                          : s[p + 1] == 'o' || s[p + 1] == 'O' ? 8
                                          : s[p + 1] == 'b' || s[p + 1] == 'B' ? 2
                                                                               : 0)
                                       : 0;
    if (base) { /* 0x1F, 0o17, 0b101 (digits with single underscores) */
      uint64_t v = 0;
      size_t ndig = 0;
      q = p + 2;
      for (; q < len; q++) {
        char d = s[q];
        int dv = d >= '0' && d <= '9' ? d - '0' : d >= 'a' && d <= 'f' ? d - 'a' + 10 : d >= 'A' && d <= 'F' ? d - 'A' + 10 : 99;
        if (d == '_' && q + 1 < len && s[q + 1] != '_') continue;
        if (dv >= base) break;
        if (v > (INT64_MAX - (uint64_t)dv) / (uint64_t)base) return fail(x, p, "%s", "an integer literal that does not fit 64 bits");
        v = v * (uint64_t)base + (uint64_t)dv;
        ndig++;
      }
      if (!ndig) return fail(x, p, "%s", "a 0x, 0o or 0b literal without digits");
      if (push(x, TK_INT, p, NULL, 0)) return -1;
      x->t[x->n - 1].i = (int64_t)v;
    } else if (isdigit((unsigned char)c)) {
      bool fl = false;
      char num[64];
      size_t k = 0;
      while (q < len && (isdigit((unsigned char)s[q]) || s[q] == '_')) {
        if (s[q] != '_' && k < sizeof num - 1) num[k++] = s[q];
        q++;
      }
      bool after_dot = x->n && x->t[x->n - 1].kind == TK_OP && x->t[x->n - 1].s[0] == '.';
      if (!after_dot && q + 1 < len && s[q] == '.' && isdigit((unsigned char)s[q + 1])) {
        fl = true;
        num[k++] = s[q++];
        while (q < len && (isdigit((unsigned char)s[q]) || s[q] == '_')) {
          if (s[q] != '_' && k < sizeof num - 1) num[k++] = s[q];
          q++;
        }
      }
      if (!after_dot && q < len && (s[q] == 'e' || s[q] == 'E')) {
        size_t r = q + 1;
        if (r < len && (s[r] == '+' || s[r] == '-')) r++;
        if (r < len && isdigit((unsigned char)s[r])) {
          fl = true;
          num[k++] = 'e';
          for (size_t m = q + 1; m < r; m++) num[k++] = s[m];
          q = r;
          while (q < len && (isdigit((unsigned char)s[q]) || s[q] == '_')) {
            if (s[q] != '_' && k < sizeof num - 1) num[k++] = s[q];
            q++;
          }
        }
      }
      num[k] = 0;
      if (k >= sizeof num - 2) return fail(x, p, "%s", "a number literal longer than 60 digits");
      if (push(x, fl ? TK_FLOAT : TK_INT, p, NULL, 0)) return -1;
      jtok *t = &x->t[x->n - 1];
      if (fl) {
        t->f = strtod(num, NULL);
      } else {
        char *e;
        unsigned long long v = strtoull(num, &e, 10);
        if (v > INT64_MAX) return fail(x, p, "integer literal %s does not fit 64 bits", num);
        t->i = (int64_t)v;
      }
    } else if (isalpha((unsigned char)c) || c == '_') {
      while (q < len && (isalnum((unsigned char)s[q]) || s[q] == '_')) q++;
      if (push(x, TK_NAME, p, s + p, q - p)) return -1;
    } else if (c == '\'' || c == '"') {
      q = p + 1;
      while (q < len && s[q] != c) q += s[q] == '\\' ? 2 : 1;
      if (q >= len) return fail(x, p, "%s", "unterminated string literal");
      char *buf = ja_alloc(x->a, q - p);
      size_t n = 0;
      if (!buf) return oom(x, p);
      if (unescape(x, p, s + p + 1, q - p - 1, buf, &n) || push(x, TK_STRING, p, buf, n)) return -1;
      q++;
    } else {
      size_t k = 0;
      for (; k < sizeof OPS / sizeof *OPS; k++) {
        size_t ol = strlen(OPS[k]);
        if (len - p >= ol && memcmp(s + p, OPS[k], ol) == 0) break;
      }
      if (k == sizeof OPS / sizeof *OPS) {
        char ch[8];
        snprintf(ch, sizeof ch, (unsigned char)c < 0x20 || (unsigned char)c >= 0x7f ? "\\x%02x" : "%c", (unsigned char)c);
        return fail(x, p, "unexpected character '%s' inside a tag", ch);
      }
      const char *op = OPS[k];
      q = p + strlen(op);
      if (strchr("([{", op[0]) && !op[1]) {
        if (depth == JINJA_MAX_DEPTH) return fail(x, p, "%s", "brackets nested deeper than 200");
        stack[depth++] = op[0] == '(' ? ')' : op[0] == '[' ? ']' : '}';
      } else if (strchr(")]}", op[0]) && !op[1]) {
        if (!depth) return fail(x, p, "unexpected '%s'", op);
        if (stack[--depth] != op[0]) {
          char m[40];
          snprintf(m, sizeof m, "unexpected '%s', expected '%c'", op, stack[depth]);
          return fail(x, p, "%s", m);
        }
      }
      if (push(x, TK_OP, p, op, strlen(op))) return -1;
    }
    p = q;
  }
}

int jinja_lex(jarena *a, const char *origin, const char *src, size_t len, jtok **toks, size_t *ntok) {
  lx x = {.a = a, .origin = origin, .src = src, .len = len, .line = 1};
  size_t pos = 0;
  while (pos < len) {
    size_t p = next_tag(src, pos, len), te = p;
    bool line_starting = pos == 0 || src[pos - 1] == '\n';
    char kind = p < len ? src[p + 1] : 0, sign = p + 2 < len ? src[p + 2] : 0;
    size_t raw_end = 0;
    char raw_open = 0, raw_close = 0;
    bool raw = kind == '%' && word_tag(src, p, len, "raw", &raw_end, &raw_open, &raw_close);
    if (p < len && sign == '-') {
      te = ws_back(src, pos, te, true);
    } else if (p < len && sign != '+' && kind != '{') { /* lstrip_blocks */
      size_t l = ws_back(src, pos, te, false);
      if (l < te && ((l > pos && src[l - 1] == '\n') || (l == pos && line_starting))) te = l;
    }
    if (te > pos && push(&x, TK_TEXT, pos, src + pos, te - pos)) return -1;
    if (p >= len) break;
    if (raw) {
      size_t q = raw_end, e = 0;
      char os = 0, cs = 0;
      if (raw_close == '-') q = ws_fwd(src, len, q);
      size_t body = q;
      for (;; q++) {
        q = next_tag(src, q, len);
        if (q >= len) return fail(&x, p, "%s", "unterminated {% raw %}: no {% endraw %} before the end");
        if (src[q + 1] == '%' && word_tag(src, q, len, "endraw", &e, &os, &cs)) break;
      }
      size_t bend = q;
      if (os == '-') {
        bend = ws_back(src, body, bend, true);
      } else if (os != '+') { /* lstrip_blocks before {% endraw %} too */
        size_t l = ws_back(src, body, bend, false);
        if (l < bend && ((l > body && src[l - 1] == '\n') || (l == body && (body == 0 || src[body - 1] == '\n'))))
          bend = l;
      }
      if (bend > body && push(&x, TK_TEXT, body, src + body, bend - body)) return -1;
      pos = after_end(src, e, len, cs, true);
      continue;
    }
    if (kind == '#') {
      size_t q = p + 2;
      while (q + 1 < len && !(src[q] == '#' && src[q + 1] == '}')) q++;
      if (q + 1 >= len) return fail(&x, p, "%s", "unterminated comment: no '#}' before the end");
      char cs = q > p + 2 && (src[q - 1] == '-' || src[q - 1] == '+') ? src[q - 1] : 0;
      pos = after_end(src, q + 2, len, cs, true);
      continue;
    }
    bool block = kind == '%';
    if (push(&x, block ? TK_BLOCK_BEGIN : TK_VAR_BEGIN, p, NULL, 0)) return -1;
    pos = p + 2 + (sign == '-' || sign == '+');
    char end_sign = 0;
    if (lex_tag(&x, p, &pos, block, &end_sign)) return -1;
    pos = after_end(src, pos, len, end_sign, block);
  }
  if (push(&x, TK_EOF, len, NULL, 0)) return -1;
  *toks = x.t;
  *ntok = x.n;
  return 0;
}
