"""ctypes declarations of include/meshlm/meshlm.h and the loading of libmeshlm.so.

Every struct below mirrors the header field for field (same order, same C
types); the enums are plain C ints.  Nothing here is public API: use
meshlm.Policy.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import sys
import threading
from ctypes import (CFUNCTYPE, POINTER, Structure, c_char_p, c_double, c_float, c_int,
                    c_int32, c_int64, c_size_t, c_uint8, c_uint64, c_void_p)
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, List, NoReturn, Optional, Tuple, Type

if TYPE_CHECKING:
    from .policy import Policy

# --- enums (meshlm_dtype, meshlm_ac, meshlm_reshard, meshlm_schedule, meshlm_loss_kind) -----
DTYPE_SOURCE, DTYPE_F32, DTYPE_BF16 = 0, 1, 2
AC_NONE, AC_FULL, AC_SELECTIVE, AC_MLP = 0, 1, 2, 3
RESHARD_DEFAULT, RESHARD_ALWAYS, RESHARD_NEVER = 0, 1, 2
LR_CONSTANT, LR_LINEAR, LR_COSINE = 0, 1, 2
LOSS_NLL, LOSS_WEIGHTED_NLL, LOSS_CLIPPED_PG = 0, 1, 2
LOSS_CUSTOM = 3
LORA_ADAPTERS, LORA_MERGED = 1, 2  # meshlm_lora_view
IS_OFF, IS_TOKEN, IS_SEQUENCE = 0, 1, 2  # meshlm_is_level
IS_TRUNC_NONE, IS_TRUNC_TIS, IS_TRUNC_ICEPOP, IS_TRUNC_SEQ_MASK_TIS = 0, 1, 2, 3

# The library version this binding mirrors (meshlm.h's MESHLM_VERSION_*);
# load() refuses another (the package's version, pyproject.toml reads it).
VERSION = "0.2.0"

c_enum = c_int  # a C enum with small non-negative values is an int on every ABI we target


class Sized(Structure):
    """A struct whose first field is struct_size (meshlm.h "Struct sizes"):
    set to this layout's size on construction; positional arguments fill the
    fields after it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(ctypes.sizeof(type(self)), *args, **kwargs)


class meshlm_options(Sized):
    _fields_ = [
        ("struct_size", c_size_t),
        ("dp_replicate", c_int),
        ("cp", c_int),
        ("tp", c_int),
        ("device", c_char_p),
        ("parallel_plan", c_char_p),
        ("sequence_parallel", c_int),
        ("param_dtype", c_enum),
        ("reduce_dtype", c_enum),
        ("ac", c_enum),
        ("lr", c_double),
        ("min_lr", c_double),
        ("beta1", c_double),
        ("beta2", c_double),
        ("eps", c_double),
        ("weight_decay", c_double),
        ("schedule", c_enum),
        ("warmup_steps", c_int64),
        ("total_steps", c_int64),
        ("max_grad_norm", c_double),
        ("micro_batch_tokens", c_int64),
        ("unshard_for_inference", c_int),
        ("grad_norm_type", c_double),
        ("output_dtype", c_enum),
        ("reshard_after_forward", c_enum),
        ("zero", c_int),
        ("prefetch_forward", c_int),
        ("prefetch_backward", c_int),
        ("cpu_offload", c_int),
        ("batch_invariant", c_int),
        ("freeze", c_char_p),
        ("ep", c_int),
        ("lora_rank", c_int64),
        ("lora_alpha", c_double),
        ("lora_dropout", c_double),
        ("lora_targets", c_char_p),
        ("lora_use_rslora", c_int),
        ("adapter", c_char_p),
        ("lora_seed", c_int64),
        ("fp32_params", c_char_p),
        ("inference_only", c_int),
    ]


class meshlm_info(Sized):
    _fields_ = [
        ("struct_size", c_size_t),
        ("rank", c_int),
        ("world", c_int),
        ("dp_replicate", c_int),
        ("dp_shard", c_int),
        ("cp", c_int),
        ("tp", c_int),
        ("dp_rank", c_int),
        ("dp_size", c_int),
        ("cp_rank", c_int),
        ("tp_rank", c_int),
        ("vocab_size", c_int64),
        ("hidden_size", c_int64),
        ("num_layers", c_int64),
        ("num_params", c_int64),
        ("bos_token_id", c_int32),
        ("eos_token_id", c_int32),
        ("step", c_int64),
        ("max_seq_len", c_int64),
    ]


class meshlm_seqs(Structure):
    _fields_ = [
        ("n", c_int64),
        ("lens", POINTER(c_int64)),
        ("tokens", POINTER(c_int32)),
    ]


class meshlm_objective_chunk(Sized):
    _fields_ = [
        ("struct_size", c_size_t),
        ("n", c_int64),
        ("logprobs", POINTER(c_float)),
        ("index", POINTER(c_int64)),
        ("seq", POINTER(c_int64)),
        ("weight", POINTER(c_float)),
        ("seq_logprobs", POINTER(c_double)),
        ("global_tokens", c_int64),
        ("global_sequences", c_int64),
        ("loss", POINTER(c_double)),
        ("grad", POINTER(c_double)),
    ]


# int (*)(void *ctx, const meshlm_objective_chunk *c)
meshlm_objective_fn = CFUNCTYPE(c_int, c_void_p, POINTER(meshlm_objective_chunk))


class meshlm_loss(Sized):
    _fields_ = [
        ("struct_size", c_size_t),
        ("kind", c_enum),
        ("sequence_level", c_int),
        ("ratio_clip_min", c_float),
        ("ratio_clip_max", c_float),
        ("ratio_clip_c", c_float),
        ("kl_penalty", c_float),
        # appended in 0.2
        ("objective", meshlm_objective_fn),
        ("objective_ctx", c_void_p),
        ("objective_seq_logprobs", c_int),
        ("is_level", c_enum),
        ("is_truncation", c_enum),
        ("is_ratio_min", c_float),
        ("is_ratio_max", c_float),
        ("entropy_coef", c_float),
    ]


class meshlm_train_batch(Sized):
    _fields_ = [
        ("struct_size", c_size_t),
        ("seqs", meshlm_seqs),
        ("token_mask", POINTER(c_uint8)),
        ("token_weights", POINTER(c_float)),
        ("seq_weights", POINTER(c_float)),
        ("old_logprobs", POINTER(c_float)),
        ("ref_logprobs", POINTER(c_float)),
        # appended in 0.2
        ("generation_logprobs", POINTER(c_float)),
        # appended (router replay)
        ("routing", POINTER(c_int32)),
    ]


class meshlm_step_result(Sized):
    _fields_ = [
        ("struct_size", c_size_t),
        ("loss", c_double),
        ("kl", c_double),
        ("clip_fraction", c_double),
        ("grad_norm", c_double),
        ("lr", c_double),
        ("tokens", c_int64),
        ("sequences", c_int64),
        ("step", c_int64),
        ("skipped", c_int),
        ("nonfinite_param", ctypes.c_char * 160),
        # appended in 0.2
        ("token_mult_prob_error", c_double),
        ("gen_kl_error", c_double),
        ("is_oob_fraction", c_double),
        ("skip_reason", ctypes.c_char * 256),
        ("entropy", c_double),
    ]


class meshlm_weight(Sized):
    _fields_ = [
        ("struct_size", c_size_t),
        ("name", c_char_p),
        ("ndim", c_int),
        ("shape", c_int64 * 2),
        ("dtype", c_enum),
    ]


class meshlm_tensor(Sized):
    _fields_ = [
        ("struct_size", c_size_t),
        ("name", c_char_p),
        ("dtype", c_enum),
        ("ndim", c_int),
        ("shape", c_int64 * 2),
        ("data", c_void_p),
    ]


class meshlm_sampling(Sized):
    _fields_ = [
        ("struct_size", c_size_t),
        ("max_new_tokens", c_int64),
        ("temperature", c_float),
        ("top_p", c_float),
        ("greedy", c_int),
        ("eos_token_id", c_int32),
        ("seed", c_uint64),
        ("n", c_int64),
        ("top_k", c_int64),
        ("min_p", c_float),
        ("n_stop", c_int64),
        ("stop_token_ids", POINTER(c_int32)),
        ("max_new_tokens_per", POINTER(c_int64)),
        ("max_running", c_int64),
        ("prefill_tokens", c_int64),
        ("replica", c_int),
        ("max_kv_bytes", c_int64),
    ]


class meshlm_call_stats(Sized):
    _fields_ = [
        ("struct_size", c_size_t),
        ("micro_batches", c_int64),
        ("tokens", c_int64),
        ("padding", c_int64),
        ("fsdp_all_gathers", c_int64),
        ("fsdp_reduce_scatters", c_int64),
        ("fsdp_all_reduces", c_int64),
        ("fsdp_bytes", c_int64),
        ("tp_collectives", c_int64),
        ("cp_collectives", c_int64),
        ("dp_replicate_collectives", c_int64),
        ("nonfinite_logprobs", c_int64),
        ("preemptions", c_int64),
    ]


class meshlm_scores(Sized):
    _fields_ = [
        ("struct_size", c_size_t),
        ("logprobs", POINTER(c_float)),
        ("seq_sums", POINTER(c_double)),
        ("entropy", POINTER(c_float)),
        ("topk", c_int32),
        ("topk_logprobs", POINTER(c_float)),
        ("topk_ids", POINTER(c_int32)),
        # appended (router replay)
        ("routing", POINTER(c_int32)),
    ]


MAX_FUSED = 2  # MESHLM_MAX_FUSED


class meshlm_fused(Structure):
    _fields_ = [
        ("leaf", c_char_p),
        ("parts", c_char_p * 4),
    ]


class meshlm_family(Sized):
    _fields_ = [
        ("struct_size", c_size_t),
        ("architecture", c_char_p),
        ("model_type", c_char_p),
        ("name", c_char_p),
        ("base", c_char_p),
        ("fused", meshlm_fused * MAX_FUSED),
        ("tp_plan_json", c_char_p),
    ]


# int (*)(void *ctx, const char *name, meshlm_dtype dtype, int ndim, const int64_t *shape,
#         const void *data, size_t nbytes)
meshlm_tensor_fn = CFUNCTYPE(c_int, c_void_p, c_char_p, c_enum, c_int, POINTER(c_int64),
                             c_void_p, c_size_t)

session_p = c_void_p  # meshlm_session * (opaque)

_PROTOTYPES = {
    "meshlm_version": (c_char_p, []),
    "meshlm_options_init": (c_int, [POINTER(meshlm_options), c_size_t]),
    "meshlm_open_f": (c_int, [c_char_p, POINTER(meshlm_options), c_int64, POINTER(session_p)]),
    "meshlm_close": (None, [session_p]),
    "meshlm_finalize": (c_int, []),
    "meshlm_error": (c_char_p, [session_p]),
    "meshlm_get_info": (c_int, [session_p, POINTER(meshlm_info)]),
    "meshlm_logprobs": (c_int, [session_p, POINTER(meshlm_seqs), POINTER(c_uint8),
                                POINTER(c_float), POINTER(c_double)]),
    "meshlm_set_reference": (c_int, [session_p]),
    "meshlm_reference_logprobs": (c_int, [session_p, POINTER(meshlm_seqs), POINTER(c_uint8),
                                          POINTER(c_float), POINTER(c_double)]),
    "meshlm_loss_init": (c_int, [POINTER(meshlm_loss), c_size_t]),
    "meshlm_train_step": (c_int, [session_p, POINTER(meshlm_train_batch), POINTER(meshlm_loss),
                                  POINTER(meshlm_step_result)]),
    "meshlm_zero_grad": (c_int, [session_p]),
    "meshlm_forward_backward": (c_int, [session_p, POINTER(meshlm_train_batch),
                                        POINTER(meshlm_loss), POINTER(meshlm_step_result)]),
    "meshlm_optimizer_step": (c_int, [session_p, POINTER(meshlm_step_result)]),
    "meshlm_eval_loss": (c_int, [session_p, POINTER(meshlm_train_batch), POINTER(meshlm_loss),
                                 POINTER(meshlm_step_result)]),
    "meshlm_save": (c_int, [session_p, c_char_p]),
    "meshlm_resume": (c_int, [session_p, c_char_p]),
    "meshlm_export": (c_int, [session_p, c_char_p, c_enum]),
    "meshlm_num_weights": (c_int64, [session_p]),
    "meshlm_weight_info": (c_int, [session_p, c_int64, POINTER(meshlm_weight)]),
    "meshlm_refit": (c_int, [session_p, c_int, c_enum, meshlm_tensor_fn, c_void_p]),
    "meshlm_refit_into": (c_int, [session_p, c_int, c_enum, POINTER(c_void_p)]),
    "meshlm_reload": (c_int, [session_p, c_char_p]),
    "meshlm_reload_tensors": (c_int, [session_p, c_int64, POINTER(meshlm_tensor)]),
    "meshlm_sampling_init": (c_int, [POINTER(meshlm_sampling), c_size_t]),
    "meshlm_generate": (c_int, [session_p, POINTER(meshlm_seqs), POINTER(meshlm_sampling),
                                POINTER(c_int32), POINTER(c_int64), POINTER(c_float)]),
    "meshlm_generate_samples": (c_int, [session_p, POINTER(meshlm_seqs),
                                        POINTER(meshlm_sampling), POINTER(c_int32),
                                        POINTER(c_int64), POINTER(c_float), POINTER(c_int32)]),
    "meshlm_last_call_stats": (c_int, [session_p, POINTER(meshlm_call_stats)]),
    "meshlm_register_family": (c_int, [POINTER(meshlm_family), c_char_p, c_size_t]),
    "meshlm_score": (c_int, [session_p, POINTER(meshlm_seqs), POINTER(c_uint8),
                             POINTER(meshlm_scores)]),
    "meshlm_refit_lora": (c_int, [session_p, c_int, c_enum, c_enum, meshlm_tensor_fn, c_void_p]),
    "meshlm_export_merged": (c_int, [session_p, c_char_p, c_enum]),
}
# without these the library is not meshlm's; any other function a library
# lacks (an older one) raises MeshlmError when called
_REQUIRED = ("meshlm_version", "meshlm_options_init", "meshlm_open_f", "meshlm_close",
             "meshlm_error", "meshlm_finalize", "meshlm_get_info")


def _missing(name: str, path: str) -> Callable[..., NoReturn]:
    def stub(*args: object) -> NoReturn:
        from .policy import MeshlmError
        raise MeshlmError("%s: not in %s (an older meshlm library)" % (name, path))
    stub.__name__ = name
    return stub

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[str] = None


def _candidates() -> List[Tuple[str, str]]:
    """Where libmeshlm.so is looked for, in order: $MESHLM_LIBRARY alone when
    set; the copy the wheel carries (pip install ./python builds it); the
    dynamic linker's; a checkout's build directory."""
    env = os.environ.get("MESHLM_LIBRARY")
    if env:
        return [("MESHLM_LIBRARY", env)]
    out = []
    carried = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libmeshlm.so")
    if os.path.exists(carried):
        out.append(("the copy in the meshlm package", carried))
    found = ctypes.util.find_library("meshlm")
    if found:
        out.append(("ctypes.util.find_library('meshlm')", found))
    # a checkout: <repo>/python/meshlm/_lib.py -> <repo>/build/libmeshlm.so
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    local = os.path.join(repo, "build", "libmeshlm.so")
    if os.path.exists(local):
        out.append(("the checkout's build directory", local))
    return out


def library_path() -> Optional[str]:
    """The path of the libmeshlm.so that is (or would be) loaded."""
    if _lib_path is not None:
        return _lib_path
    c = _candidates()
    return c[0][1] if c else None


def load() -> ctypes.CDLL:
    """Load libmeshlm.so once (RTLD_GLOBAL: Open MPI's plugins resolve libmpi's
    symbols globally) and declare the prototypes; register meshlm_finalize
    with atexit.  Raises OSError naming every place looked at."""
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            return _lib
        cands = _candidates()
        if not cands:
            raise OSError(
                "meshlm: libmeshlm.so not found: set MESHLM_LIBRARY to its path, install it "
                "where the dynamic linker finds it (ldconfig / LD_LIBRARY_PATH), or build it in "
                "the checkout (cmake -S . -B build && cmake --build build)")
        errors = []
        for where, path in cands:
            try:
                lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                errors.append("%s (%s): %s" % (path, where, e))
                continue
            missing = [n for n in _REQUIRED if not hasattr(lib, n)]
            if missing:
                errors.append("%s (%s): not the meshlm library API (missing %s)"
                              % (path, where, ", ".join(missing)))
                continue
            lib.meshlm_version.restype = c_char_p
            found = lib.meshlm_version().decode()
            if found != VERSION:  # the structs below mirror this version's header
                errors.append("%s (%s): libmeshlm %s; this binding is %s (rebuild one of them)"
                              % (path, where, found, VERSION))
                continue
            for name, (res, args) in _PROTOTYPES.items():
                if not hasattr(lib, name):
                    setattr(lib, name, _missing(name, path))
                    continue
                f = getattr(lib, name)
                f.restype = res
                f.argtypes = args
            _lib, _lib_path = lib, path
            atexit.register(_at_exit)
            _chain_excepthook()
            return lib
        raise OSError("meshlm: could not load libmeshlm.so:\n  " + "\n  ".join(errors))


# Sessions still open at exit are closed (in reverse order of opening, the
# same on every rank) before MPI is finalised.
_open_sessions: List[Policy] = []  # the open Policy objects, in order of opening
_uncaught: List[Type[BaseException]] = []  # set when the interpreter exits on an uncaught exception


def _chain_excepthook() -> None:
    prev = sys.excepthook

    def hook(t: Type[BaseException], v: BaseException, tb: Optional[TracebackType]) -> None:
        _uncaught.append(t)
        prev(t, v, tb)

    sys.excepthook = hook


def _at_exit() -> None:
    # A rank that dies of an uncaught exception must not make collective
    # calls (close, MPI_Finalize): the other ranks are elsewhere and would
    # wait for it forever.  It exits at once with status 1 instead, without
    # finalising MPI, and the launcher (mpirun) ends the job's other ranks.
    if _uncaught and any(p._world() > 1 for p in _open_sessions):
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(1)
    while _open_sessions:
        p = _open_sessions[-1]
        try:
            p.close()
        except Exception:  # pragma: no cover - best effort at exit
            if _open_sessions and _open_sessions[-1] is p:
                _open_sessions.pop()
    if _lib is not None:
        _lib.meshlm_finalize()
