/* meshlm: train and score Hugging Face decoder LMs across a device mesh.
 * Run plainly (one rank) or under mpirun (one rank per process). The
 * program is the library's (libmeshlm.so, meshlm_cli_main). */
#include "meshlm/meshlm.h"

int main(int argc, char **argv) { return meshlm_cli_main(argc, argv); }
