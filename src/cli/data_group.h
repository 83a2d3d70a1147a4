/* The data loader's group (data/data.h ml_data_group) over the CLI's host
 * channel: every rank of the run reads its part of --data / --eval-data and
 * the parts are all-gathered over MPI (comm/host.h), so the data layer
 * stays free of MPI (ARCHITECTURE.md §1). */
#ifndef ML_CLI_DATA_GROUP_H
#define ML_CLI_DATA_GROUP_H

#include "comm/host.h"
#include "data/data.h"

/* A group over `world`'s ranks (world must outlive it): all_gather_v is
 * ml_host_all_gather_v, agree is ml_host_agree. */
ml_data_group ml_cli_data_group(ml_host *world);

#endif
