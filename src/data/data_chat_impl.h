/* The inside of ml_chat (data/data_chat.h), shared by its loader
 * (data_chat.c) and its renderer (data_chat_render.c). */
#ifndef ML_DATA_CHAT_IMPL_H
#define ML_DATA_CHAT_IMPL_H

#include <jansson.h>

#include "template/jinja.h"

struct ml_chat {
  ml_jinja *tmpl;     /* the default template */
  ml_jinja *tool_use; /* the "tool_use" one, for records with tools; NULL: none */
  char *origin;       /* where tmpl came from, for messages */
  char *tool_origin;
  json_t *tokens; /* the named special tokens as strings: {"bos_token": "...", ...} */
};

#endif
