/* json_check [KEY.PATH ...] < doc.json: exit 0 when stdin is one valid JSON
 * document (jansson, duplicate keys rejected) in which every dotted object
 * path given exists ("plan.name", "per_tp_rank"); else print why and exit
 * 1. For the CLI tests (tests/cli/test_*.sh), without relying on python3 or jq. */
#include <jansson.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
  json_error_t e;
  json_t *root = json_loadf(stdin, JSON_REJECT_DUPLICATES, &e);
  if (!root) {
    fprintf(stderr, "json_check: invalid JSON at line %d, column %d: %s\n", e.line, e.column,
            e.text);
    return 1;
  }
  int rc = 0;
  for (int i = 1; i < argc; i++) {
    char path[256];
    snprintf(path, sizeof path, "%s", argv[i]);
    json_t *v = root;
    for (char *key = strtok(path, "."); key && v; key = strtok(NULL, "."))
      v = json_is_object(v) ? json_object_get(v, key) : NULL;
    if (!v) {
      fprintf(stderr, "json_check: no field '%s'\n", argv[i]);
      rc = 1;
    }
  }
  json_decref(root);
  return rc;
}
