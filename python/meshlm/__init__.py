"""meshlm: Python binding (ctypes) of libmeshlm, the C runtime that trains and
scores Hugging Face decoder LMs over a device mesh of MPI ranks.

    import meshlm
    with meshlm.Policy("model_dir", tp=2, lr=1e-5) as p:
        lps, sums = p.logprobs([ids0, ids1])           # per-token log-probs
        r = p.train_step(seqs, loss="clipped_pg", ...)  # one optimizer step
        weights = p.refit()                             # dict name -> array

Run one process per rank (`mpirun -np N python3 script.py`); every rank
makes the same collective calls in the same order.  The library is found via
$MESHLM_LIBRARY, the dynamic linker (ctypes.util.find_library("meshlm")),
or a checkout's build/libmeshlm.so.

Arrays: every argument that takes a numpy array also takes a torch tensor
(or any DLPack producer) in host memory without a copy; to_torch(result)
hands results to torch without a copy (bf16 bits as torch.bfloat16),
bf16_array(bits) as ml_dtypes.bfloat16 where installed (meshlm.interop).

The package is typed (PEP 561: it carries py.typed): PolicyInfo, StepResult
and CallStats are the TypedDicts of Policy.info, train_step() and
last_call_stats(); TokenSeqs, PerToken, WeightArray and StrPath the aliases
of its arguments and results.
"""

from ._lib import VERSION as __version__, library_path
from .policy import (CallStats, Communicator, MeshlmError, PerToken, Policy, PolicyInfo,
                     StepResult, StrPath, TokenSeqs, WeightArray, bf16_to_f32, f32_to_bf16,
                     register_family, version)
from .policy import Objective, ObjectiveChunk
from .interop import as_numpy, bf16_array, to_torch

__all__ = ["Policy", "MeshlmError", "bf16_to_f32", "f32_to_bf16", "register_family", "version",
           "library_path", "__version__",
           # types of the API (the package is typed: PEP 561 py.typed)
           "PolicyInfo", "StepResult", "CallStats", "Communicator", "TokenSeqs", "PerToken",
           "WeightArray", "StrPath", "Objective", "ObjectiveChunk",
           # zero-copy interchange (DLPack; torch, ml_dtypes optional)
           "as_numpy", "to_torch", "bf16_array"]
