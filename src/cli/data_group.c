/* The data loader's group over the host channel (cli/data_group.h). */
#include "cli/data_group.h"

static int gather(void *ctx, const void *send, const size_t *bytes, void *recv) {
  return ml_host_all_gather_v(ctx, send, bytes, recv);
}

static int agree(void *ctx, int rc) { return ml_host_agree(ctx, rc); }

ml_data_group ml_cli_data_group(ml_host *world) {
  return (ml_data_group){.rank = world->rank,
                         .size = world->size,
                         .ctx = world,
                         .all_gather_v = gather,
                         .agree = agree};
}
