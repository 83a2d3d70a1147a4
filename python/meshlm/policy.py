"""meshlm.Policy: one meshlm session (include/meshlm/meshlm.h) driven from Python.

Conventions (those of the C API):

* Collective methods (marked COLLECTIVE) must be called by every rank of the
  session's communicator, in the same order.  On an error every rank raises
  MeshlmError with the first failing rank's message.
* Each data-parallel rank passes its own sequences; the tp / cp ranks of one
  data-parallel rank (``info["dp_rank"]``) must pass identical batches.
* A batch is a list of 1-D integer arrays (any integer dtype; converted to
  int32 token ids), variable length, never padded.  Per-token inputs and
  outputs are *prediction aligned*: a sequence of L tokens has L - 1 of them,
  entry t for token t + 1 predicted from tokens 0..t.  They are given either as
  a list of per-sequence arrays (lengths L_k - 1) or as one array of all of
  them concatenated (length sum(L_k - 1)).
* Log-probs are natural logs, float32; sums are accumulated in float64.
* bf16 tensors are numpy uint16 arrays holding the raw bits (numpy has no
  bfloat16): see bf16_to_f32 / f32_to_bf16.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import warnings
from collections.abc import Mapping as _MappingABC
from ctypes import POINTER, byref, c_double, c_float, c_int32, c_int64, c_uint8, c_void_p
# Literal, Protocol and TypedDict are in typing since Python 3.8 (no typing_extensions)
from typing import (Any, Callable, Dict, List, Literal, Mapping, NoReturn, Optional, Protocol,
                    Sequence, Tuple, Type, TypedDict, TypeVar, Union, cast, overload)

import numpy as np
from numpy.typing import ArrayLike, NDArray  # numpy >= 1.21

from . import _lib as L
from .interop import as_numpy

__all__ = ["Policy", "MeshlmError", "bf16_to_f32", "f32_to_bf16", "version", "register_family",
           "PolicyInfo", "StepResult", "CallStats", "Communicator",
           "TokenSeqs", "PerToken", "WeightArray", "StrPath", "ObjectiveChunk", "Objective"]

# --- types of the public API (PEP 561: the package carries py.typed) ---------------------------

#: A path: str, bytes or an os.PathLike (os.fsencode takes it).
StrPath = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]
#: A batch: a sequence (list or tuple) of 1-D integer token-id arrays (any integer dtype,
#: variable length), or a 2-D integer array, one sequence per row.
TokenSeqs = Union[Sequence[ArrayLike], "NDArray[np.integer[Any]]"]
#: A prediction-aligned per-token input: a sequence of per-sequence 1-D arrays (lengths
#: L_k - 1), or one flat 1-D array of them all concatenated (length sum(L_k - 1)).
PerToken = Union[Sequence[ArrayLike], ArrayLike]
#: A full weight tensor: float32 values, or bf16 raw bits as uint16 (bf16_to_f32 converts).
WeightArray = Union["NDArray[np.float32]", "NDArray[np.uint16]"]


class Communicator(Protocol):
    """An MPI communicator as mpi4py's: its Fortran handle is py2f()."""

    def py2f(self) -> int: ...


class PolicyInfo(TypedDict):
    """Policy.info: this rank's place in the mesh and the model (meshlm_info)."""

    rank: int
    world: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    tp_rank: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_params: int
    bos_token_id: int
    eos_token_id: int
    step: int
    max_seq_len: int


class StepResult(TypedDict):
    """What Policy.train_step, forward_backward, optimizer_step and eval_loss
    return (meshlm_step_result)."""

    loss: float
    kl: float
    clip_fraction: float
    grad_norm: float
    lr: float
    tokens: int
    sequences: int
    step: int
    skipped: bool
    nonfinite_param: str
    token_mult_prob_error: float
    gen_kl_error: float
    is_oob_fraction: float
    skip_reason: str
    entropy: float


class ObjectiveChunk:
    """One call of a Python objective (meshlm_objective_chunk in meshlm.h, its
    contract): n trained targets of this rank, a chunk of a micro-batch.

    logprobs [n] float32: log p of each target under the current weights.
    index [n] int64: its place in this rank's prediction-aligned batch arrays.
    seq [n] int64: its sequence in this rank's batch.
    weight [n] float32: its weight in the built-in normalisation (token level:
        1 / global masked targets; sequence level: 1 / (its sequence's masked
        targets x global sequences with one)).
    seq_logprobs [n_seqs] float64 or None: each sequence's sum of masked
        log-probs at these weights (with seq_logprobs=True).
    global_tokens, global_sequences: counts over the global batch.
    tensors: the caller's per-token tensors at index and per-sequence ones
        at seq (dict name -> [n] array).
    The objective returns (loss terms [n], dL/dlogprobs [n]): the terms
    already normalised (the loss is their sum over the global batch)."""

    __slots__ = ("logprobs", "index", "seq", "weight", "seq_logprobs", "global_tokens",
                 "global_sequences", "tensors")

    def __init__(self, logprobs: NDArray[np.float32], index: NDArray[np.int64],
                 seq: NDArray[np.int64], weight: NDArray[np.float32],
                 seq_logprobs: Optional[NDArray[np.float64]], global_tokens: int,
                 global_sequences: int, tensors: Dict[str, NDArray[Any]]) -> None:
        self.logprobs = logprobs
        self.index = index
        self.seq = seq
        self.weight = weight
        self.seq_logprobs = seq_logprobs
        self.global_tokens = global_tokens
        self.global_sequences = global_sequences
        self.tensors = tensors


#: A Python objective: ObjectiveChunk -> (loss terms [n], dL/dlogprobs [n]), float arrays.
Objective = Callable[[ObjectiveChunk], Tuple[ArrayLike, ArrayLike]]


class CallStats(TypedDict):
    """Policy.last_call_stats(): what the last logprobs / train_step did (meshlm_call_stats)."""

    micro_batches: int
    tokens: int
    padding: int
    fsdp_all_gathers: int
    fsdp_reduce_scatters: int
    fsdp_all_reduces: int
    fsdp_bytes: int
    tp_collectives: int
    cp_collectives: int
    dp_replicate_collectives: int
    nonfinite_logprobs: int
    preemptions: int

_INT32_MIN, _INT32_MAX = -(2 ** 31), 2 ** 31 - 1


# "train.c:28: " in a library message: where in the C sources it arose
_C_LOCATION_RE = re.compile(r"(?:^|(?<=: ))([A-Za-z_][\w/]*\.c:\d+): ")


class MeshlmError(RuntimeError):
    """An error of the meshlm library (its message: meshlm_error) or of the
    arguments of a Policy method.  ``str(e)`` is the message, without the C
    source location the library adds, which is kept in ``e.c_location``
    ("train.c:28", for a bug report; None when there is none)."""

    c_location: Optional[str]

    def __init__(self, message: str) -> None:
        m = _C_LOCATION_RE.search(message)
        self.c_location = m.group(1) if m else None
        if m:
            message = message[:m.start(1)] + message[m.end():]
        super().__init__(message)


def version() -> str:
    """The library's version string (meshlm_version), e.g. "0.2.0"."""
    return str(L.load().meshlm_version().decode())


def register_family(architecture: str, model_type: str, name: str, base: str,
                    fused: Optional[Mapping[str, Sequence[str]]] = None,
                    tp_plan: Optional[Mapping[str, str]] = None) -> None:
    """Register a model family for this process (meshlm_register_family; call it
    on every rank before a Policy opens such a checkpoint): the HF
    `architecture` / `model_type` read as the built-in family `base`'s block
    ("llama", "mistral", "phi3", "qwen2", "qwen3", "gemma3", "qwen3_moe", "qwen2_moe",
    "mixtral").

    fused: up to two {fused module: [parts]} entries, e.g.
        {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]}
    (the checkpoint stacks the parts' rows in that order).
    tp_plan: the family's tensor-parallel plan, a dict {pattern: style} as a
    --parallel-plan file (patterns relative to the base model), or None.
    Raises MeshlmError with the library's reason when it is refused."""
    f = L.meshlm_family()
    keep: List[bytes] = []  # the encoded strings must outlive the call

    def enc(s: str) -> bytes:
        b = s.encode()
        keep.append(b)
        return b

    f.architecture, f.model_type, f.name, f.base = (enc(architecture), enc(model_type),
                                                    enc(name), enc(base))
    items = list((fused or {}).items())
    if len(items) > L.MAX_FUSED:
        raise MeshlmError("register_family: %d fused tensors; expected at most %d"
                          % (len(items), L.MAX_FUSED))
    for i, (leaf, parts) in enumerate(items):
        if not 2 <= len(parts) <= 3:
            raise MeshlmError("register_family: fused %r has %d parts; expected 2 or 3"
                              % (leaf, len(parts)))
        f.fused[i].leaf = enc(leaf)
        for j, part in enumerate(parts):
            f.fused[i].parts[j] = enc(part)
    if tp_plan is not None:
        f.tp_plan_json = enc(json.dumps(tp_plan))
    err = ctypes.create_string_buffer(1024)
    if L.load().meshlm_register_family(ctypes.byref(f), err, len(err)) != 0:
        raise MeshlmError(err.value.decode())


# --- bf16 helpers -----------------------------------------------------------------------------

def bf16_to_f32(bits: ArrayLike) -> NDArray[np.float32]:
    """bf16 values stored as raw bits (numpy uint16, any shape: what refit and
    refit_stream return for bf16 tensors) -> float32 array of the same shape.
    Exact: a bf16 value is the upper half of the float32 with that value."""
    b = np.asarray(bits)
    if b.dtype != np.uint16:
        raise TypeError("bf16_to_f32: expected uint16 bits, got %s" % b.dtype)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(values: ArrayLike) -> NDArray[np.uint16]:
    """float32 values (any shape) -> bf16 raw bits (uint16), rounded to
    nearest even as torch's .to(torch.bfloat16); NaN stays a (quiet) NaN.
    For reload_tensors with bf16 tensors."""
    v = np.ascontiguousarray(values, dtype=np.float32)
    u = v.view(np.uint32).astype(np.uint64)
    rounded = ((u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16))
    nan = np.isnan(v)
    out = np.where(nan, (u >> np.uint64(16)) | np.uint64(0x40), rounded)
    bits: NDArray[np.uint16] = out.astype(np.uint16)  # (np.where is untyped in older numpy)
    return bits


# --- option names -----------------------------------------------------------------------------

_DTYPES = {"source": L.DTYPE_SOURCE, "fp32": L.DTYPE_F32, "f32": L.DTYPE_F32,
           "float32": L.DTYPE_F32, "bf16": L.DTYPE_BF16, "bfloat16": L.DTYPE_BF16}
_DTYPE_NAMES = {L.DTYPE_SOURCE: "source", L.DTYPE_F32: "fp32", L.DTYPE_BF16: "bf16"}
_LORA_VIEWS = {"adapters": L.LORA_ADAPTERS, "merged": L.LORA_MERGED}
_AC = {"none": L.AC_NONE, "full": L.AC_FULL, "layer": L.AC_FULL, "selective": L.AC_SELECTIVE,
       "mlp": L.AC_MLP}
_RESHARD = {"default": L.RESHARD_DEFAULT, "true": L.RESHARD_ALWAYS, "always": L.RESHARD_ALWAYS,
            "false": L.RESHARD_NEVER, "never": L.RESHARD_NEVER}
_NORMS = {"2": 2.0, "2.0": 2.0, "inf": float("inf")}  # by str(value): 2, 2.0, "inf", math.inf
_SCHEDULES = {"constant": L.LR_CONSTANT, "linear": L.LR_LINEAR, "cosine": L.LR_COSINE}
_LOSSES = {"nll": L.LOSS_NLL, "weighted_nll": L.LOSS_WEIGHTED_NLL,
           "clipped_pg": L.LOSS_CLIPPED_PG}
_IS_LEVELS = {"off": L.IS_OFF, "token": L.IS_TOKEN, "sequence": L.IS_SEQUENCE}
_IS_TRUNCATIONS = {"none": L.IS_TRUNC_NONE, "tis": L.IS_TRUNC_TIS, "icepop": L.IS_TRUNC_ICEPOP,
                   "seq-mask-tis": L.IS_TRUNC_SEQ_MASK_TIS}


class _ObjectiveCall:
    """A Python objective behind meshlm_objective_fn for one call: the
    caller's tensors of this rank's batch, the first exception it raised (the
    C call then fails on every rank; Policy re-raises it chained)."""

    def __init__(self, fn: Objective, n_seqs: int, tensors: Dict[str, NDArray[Any]],
                 seq_tensors: Dict[str, NDArray[Any]]) -> None:
        self.fn = fn
        self.n_seqs = n_seqs
        self.tensors = tensors
        self.seq_tensors = seq_tensors
        self.error: Optional[BaseException] = None
        self.c_fn = L.meshlm_objective_fn(self._call)

    def _call(self, ctx: Optional[int], cp: Any) -> int:
        if self.error is not None:
            return 1
        try:
            c = cp.contents
            n = int(c.n)
            index = np.ctypeslib.as_array(c.index, (n,))
            seq = np.ctypeslib.as_array(c.seq, (n,))
            tensors = {k: v[index] for k, v in self.tensors.items()}
            tensors.update({k: v[seq] for k, v in self.seq_tensors.items()})
            sums = None
            if c.seq_logprobs:
                sums = np.ctypeslib.as_array(c.seq_logprobs, (self.n_seqs,)).copy()
            chunk = ObjectiveChunk(np.ctypeslib.as_array(c.logprobs, (n,)).copy(), index.copy(),
                                   seq.copy(), np.ctypeslib.as_array(c.weight, (n,)).copy(),
                                   sums, int(c.global_tokens), int(c.global_sequences),
                                   tensors)
            loss, grad = self.fn(chunk)
            loss_a = np.asarray(loss, dtype=np.float64)
            grad_a = np.asarray(grad, dtype=np.float64)
            if loss_a.shape != (n,) or grad_a.shape != (n,):
                raise ValueError("objective: returned loss of shape %s and grad of shape %s; "
                                 "expected (%d,) each (one per target of the chunk)"
                                 % (loss_a.shape, grad_a.shape, n))
            np.ctypeslib.as_array(c.loss, (n,))[:] = loss_a
            np.ctypeslib.as_array(c.grad, (n,))[:] = grad_a
            return 0
        except BaseException as e:  # noqa: B036 (any error: the C call must go on)
            self.error = e
            return 1


def _bool_int(value: object) -> int:
    return int(bool(value))


def _bool_word(value: Union[str, bool], if_true: str, if_false: str) -> str:
    """True / False as the word of an option that also takes them; else value."""
    if value is True or value is False:
        return if_true if value else if_false
    return value


_V = TypeVar("_V")
_G = TypeVar("_G", bound="np.generic")


def _choice(table: Mapping[str, _V], value: object, what: str,
            exclude: Sequence[str] = ()) -> _V:
    key = value.lower() if isinstance(value, str) else value
    if not isinstance(key, str) or key not in table or key in exclude:
        names = [k for k in table if k not in exclude]
        raise MeshlmError("%s: %r is not one of %s" % (what, value, ", ".join(names)))
    return table[key]


def _np_dtype(dtype: int) -> Union[Type[np.float32], Type[np.uint16]]:
    return np.float32 if dtype == L.DTYPE_F32 else np.uint16


def _ptr(a: Optional[NDArray[Any]], ctype: Any) -> Any:
    return None if a is None else a.ctypes.data_as(POINTER(ctype))


class _ArgError(Exception):
    """An argument error found in Python before a collective call."""


# --- batches ----------------------------------------------------------------------------------

class _Batch:
    """A list of sequences as the C API wants it: lens [n] int64 and tokens
    [sum lens] int32, kept alive with the meshlm_seqs pointing at them."""

    def __init__(self, seqs: TokenSeqs, what: str = "seqs") -> None:
        rows: List[ArrayLike]
        if isinstance(seqs, np.ndarray):
            if seqs.ndim != 2:
                raise _ArgError("%s: expected a list of 1-D token arrays (or a 2-D array, one "
                                "sequence per row), got a %d-D array" % (what, seqs.ndim))
            rows = list(seqs)
        elif isinstance(seqs, (list, tuple)):
            rows = list(seqs)
        else:
            raise _ArgError("%s: expected a list of 1-D token arrays, got %s"
                            % (what, type(seqs).__name__))
        arrays: List[NDArray[Any]] = []
        for k, r in enumerate(rows):
            a = as_numpy(r)
            if a.ndim != 1:
                raise _ArgError("%s[%d]: expected a 1-D array of token ids, got shape %s"
                                % (what, k, a.shape))
            if a.size == 0:
                a = a.astype(np.int32)
            elif a.dtype.kind not in "iu":
                raise _ArgError("%s[%d]: expected integer token ids, got dtype %s"
                                % (what, k, a.dtype))
            elif a.dtype.itemsize >= 4 and a.dtype != np.int32:
                lo, hi = int(a.min()), int(a.max())
                if lo < _INT32_MIN or hi > _INT32_MAX:
                    raise _ArgError("%s[%d]: token id %d does not fit int32"
                                    % (what, k, lo if lo < _INT32_MIN else hi))
            arrays.append(a)
        self.n = len(arrays)
        self.lens = np.array([a.size for a in arrays], dtype=np.int64)
        self.tokens = (np.concatenate(arrays).astype(np.int32, copy=False) if arrays
                       else np.zeros(0, np.int32))
        self.tokens = np.ascontiguousarray(self.tokens)
        # prediction-aligned entries of each sequence (a length < 1 is the library's error to
        # report; it gets no entries here)
        self.pred = np.maximum(self.lens - 1, 0)
        self.total = int(self.pred.sum())
        self.c = L.meshlm_seqs(self.n, _ptr(self.lens, c_int64), _ptr(self.tokens, c_int32))

    def split(self, flat: NDArray[_G]) -> List[NDArray[_G]]:
        """Per-sequence views of a prediction-aligned array of length total."""
        return np.split(flat, np.cumsum(self.pred)[:-1]) if self.n else []

    def per_token(self, x: Optional[PerToken], what: str,
                  dtype: Type[_G]) -> Optional[NDArray[_G]]:
        """A prediction-aligned input (list of per-sequence arrays, or one
        concatenated array) as one contiguous array of dtype, length total."""
        if x is None:
            return None
        if isinstance(x, (list, tuple)) and len(x) > 0 and all(as_numpy(e).ndim == 1 for e in x):
            if len(x) != self.n:
                raise _ArgError("%s: %d per-sequence arrays for %d sequences"
                                % (what, len(x), self.n))
            parts: List[NDArray[Any]] = []
            for k, e in enumerate(x):
                a = as_numpy(e)
                if a.size != self.pred[k]:
                    raise _ArgError("%s[%d]: %d entries for a sequence of %d tokens (expected "
                                    "len - 1 = %d: prediction aligned)"
                                    % (what, k, a.size, self.lens[k], self.pred[k]))
                parts.append(a)
            a = np.concatenate(parts) if parts else np.zeros(0)
        else:
            a = as_numpy(x)
            if a.ndim != 1 or a.size != self.total:
                raise _ArgError("%s: shape %s, expected (%d,): sum over sequences of len - 1 "
                                "(prediction aligned), or a list of per-sequence arrays"
                                % (what, a.shape, self.total))
        if dtype == np.uint8 and a.dtype != np.bool_:
            bad = np.flatnonzero((a != 0) & (a != 1))
            if bad.size:
                k, t = self.locate(int(bad[0]))
                raise _ArgError("%s: value %r at sequence %d, entry %d; expected 0 or 1"
                                % (what, a[bad[0]].item(), k, t))
        return np.ascontiguousarray(a, dtype=dtype)

    def locate(self, i: int) -> Tuple[int, int]:
        """Entry i of a prediction-aligned array as (sequence, entry in it)."""
        k = int(np.searchsorted(np.cumsum(self.pred), i, side="right"))
        return k, i - int(self.pred[:k].sum())

    def per_seq(self, x: Optional[ArrayLike], what: str,
                dtype: Type[_G]) -> Optional[NDArray[_G]]:
        """A per-sequence input [n]."""
        if x is None:
            return None
        a = as_numpy(x)
        if a.ndim != 1 or a.size != self.n:
            raise _ArgError("%s: shape %s, expected (%d,): one value per sequence"
                            % (what, a.shape, self.n))
        return np.ascontiguousarray(a, dtype=dtype)


def _step_result(r: L.meshlm_step_result) -> StepResult:
    return {"loss": r.loss, "kl": r.kl, "clip_fraction": r.clip_fraction,
            "grad_norm": r.grad_norm, "lr": r.lr, "tokens": int(r.tokens),
            "sequences": int(r.sequences), "step": int(r.step), "skipped": bool(r.skipped),
            "nonfinite_param": r.nonfinite_param.decode("utf-8", "replace"),
            "token_mult_prob_error": r.token_mult_prob_error, "gen_kl_error": r.gen_kl_error,
            "is_oob_fraction": r.is_oob_fraction,
            "skip_reason": r.skip_reason.decode("utf-8", "replace"), "entropy": r.entropy}


_POISON_BASE = 1000000000


def _poison_seqs(rank: int) -> Tuple[NDArray[np.int64], NDArray[np.int32], L.meshlm_seqs]:
    """A batch every rank's library refuses (one token, id -(10^9 + rank)):
    sent by a rank whose own arguments were wrong, so that the collective call
    fails on every rank instead of the other ranks waiting for this one.  The
    other ranks' error names the rank (see Policy._check)."""
    lens = np.ones(1, np.int64)
    toks = np.array([-(_POISON_BASE + rank)], np.int32)
    return lens, toks, L.meshlm_seqs(1, _ptr(lens, c_int64), _ptr(toks, c_int32))


_POISON_RE = re.compile(r"id -(1\d{9})\b")


# --- the policy -------------------------------------------------------------------------------

class Policy:
    """A model sharded over a device mesh of MPI ranks: score, train, save,
    export, refit, reload, sample (one meshlm session).

    COLLECTIVE: every rank of the communicator constructs it with the same
    arguments (model_dir may differ only by path spelling).  Use it as a context
    manager, or call close() (COLLECTIVE) on every rank; sessions left open
    are closed at exit, before MPI is finalised.

    model_dir: an HF checkpoint (config.json + safetensors; Llama, Qwen2,
    Qwen3, Gemma 3).  Options default to meshlm_options_default; only those
    given (not None) are changed:

    tp, cp, dp_replicate: mesh sizes; dp_shard = world / (dp_replicate*cp*tp).
    ep: expert-parallel size of a mixture-of-experts model (README: --ep): its
    experts split over groups of ep consecutive ranks, tokens exchanged by
    all-to-all; the world and num_experts must be multiples of it.
    device: "cpu" or "cuda" (one GPU per rank).
    parallel_plan: None/"auto", "optimized", "hf", "default" or a plan file.
    sequence_parallel: bool.
    param_dtype, reduce_dtype, output_dtype: "fp32" or "bf16" (FSDP2
    MixedPrecisionPolicy).
    reshard_after_forward: "default", "true"/"always" (or True), "false"/"never"
    (or False).
    zero: ZeRO stage 1, 2 or 3; prefetch_forward, prefetch_backward: FSDP
    units all-gathered ahead (0: none).
    cpu_offload: bool, FSDP2's CPUOffloadPolicy (shards, grads and AdamW state
    in host memory, the optimizer step on the host; the same numbers).
    activation_checkpointing: "none", "full" (alias "layer", True), "selective"
    or "mlp".
    lr, min_lr, betas=(beta1, beta2), eps, weight_decay: AdamW.
    schedule: "constant", "linear" or "cosine"; warmup_steps, total_steps.
    max_grad_norm: clipping (0: none) in grad_norm_type: 2 or "inf".
    (README.md "Defaults": each option's CLI flag and both defaults.)
    micro_batch_tokens: tokens per rank per micro-batch (packing).
    unshard_for_inference: keep the model unsharded during logprobs calls.
    batch_invariant: bool, every token's log-prob the same bits whatever batch,
    packing, micro_batch_tokens, dp, cp or tp size or KV-cache step computes it
    (logprobs, the training forward and generate's log-probs alike; CPU only);
    under tp each row-parallel linear (o_proj, down_proj, and its LoRA
    adapter) is computed whole on every tp rank from all-gathered inputs and
    weights, as one rank does, so the tp size does not change the bits.
    freeze: fnmatch patterns of HF parameter names to freeze (requires_grad=False:
    no gradient, no AdamW state or update, not in the grad norm), a list of
    strings or one comma-separated string, e.g. ["model.embed_tokens.*",
    "model.layers.0.*"]; a pattern matching nothing or freezing everything
    raises MeshlmError (README: --freeze).
    lora_rank, lora_alpha, lora_dropout ([0, 1)), lora_targets (a list of linear
    module names or one comma-separated string, or "all-linear"), lora_use_rslora,
    lora_seed: LoRA adapters with PEFT LoraConfig's semantics, every base weight
    frozen (README: --lora-rank); adapter: a PEFT LoRA adapter directory to start
    from.
    fp32_params: fnmatch patterns of HF parameter names kept and computed in fp32
    under param_dtype "bf16" besides the mixture-of-experts routers (fp32
    all-gather and GEMMs: NeMo Automodel's fully_shard_by_dtype), a list of
    strings or one comma-separated string; a pattern matching nothing raises
    MeshlmError (README: --fp32-params).
    inference_only: bool, the policy only scores and generates (an RL reference or
    log-prob worker): no gradients or AdamW state, and under param_dtype "bf16"
    the weights held in bf16 alone (no fp32 masters), the same log-probs bit for
    bit; training, save, export and refit then raise MeshlmError naming
    inference_only, reload and reload_tensors still load new weights (meshlm.h
    meshlm_options.inference_only).
    comm: None (MPI_COMM_WORLD), an mpi4py communicator (its py2f() handle is
    used) or a Fortran communicator handle (int).
    reference: capture the initial weights as the reference policy
    (set_reference(); reference_logprobs()).
    """

    model_dir: Union[str, bytes]

    def __init__(self, model_dir: StrPath, *, tp: Optional[int] = None, cp: Optional[int] = None,
                 dp_replicate: Optional[int] = None, device: Optional[str] = None,
                 parallel_plan: Optional[StrPath] = None,
                 sequence_parallel: Optional[bool] = None, param_dtype: Optional[str] = None,
                 reduce_dtype: Optional[str] = None,
                 activation_checkpointing: Optional[Union[str, bool]] = None,
                 lr: Optional[float] = None, min_lr: Optional[float] = None,
                 betas: Optional[Sequence[float]] = None, eps: Optional[float] = None,
                 weight_decay: Optional[float] = None, schedule: Optional[str] = None,
                 warmup_steps: Optional[int] = None, total_steps: Optional[int] = None,
                 max_grad_norm: Optional[float] = None, micro_batch_tokens: Optional[int] = None,
                 unshard_for_inference: Optional[bool] = None, output_dtype: Optional[str] = None,
                 reshard_after_forward: Optional[Union[str, bool]] = None,
                 zero: Optional[int] = None, prefetch_forward: Optional[int] = None,
                 prefetch_backward: Optional[int] = None,
                 grad_norm_type: Optional[Union[float, str]] = None,
                 cpu_offload: Optional[bool] = None,
                 batch_invariant: Optional[bool] = None,
                 freeze: Optional[Union[str, Sequence[str]]] = None,
                 ep: Optional[int] = None,
                 lora_rank: Optional[int] = None, lora_alpha: Optional[float] = None,
                 lora_dropout: Optional[float] = None,
                 lora_targets: Optional[Union[str, Sequence[str]]] = None,
                 lora_use_rslora: Optional[bool] = None, lora_seed: Optional[int] = None,
                 adapter: Optional[StrPath] = None,
                 fp32_params: Optional[Union[str, Sequence[str]]] = None,
                 inference_only: Optional[bool] = None,
                 comm: Optional[Union[int, Communicator]] = None,
                 reference: bool = False) -> None:
        self._s: Optional[c_void_p] = None
        self._info: Optional[PolicyInfo] = None
        lib = self._lib = L.load()
        o = L.meshlm_options()
        lib.meshlm_options_init(byref(o), ctypes.sizeof(o))
        # the strings the options point at live as long as the policy
        self._keep: List[bytes] = []

        def cstr(v: object) -> bytes:
            b = os.fsencode(v) if isinstance(v, (str, bytes, os.PathLike)) else None
            if b is None:
                raise MeshlmError("expected a string, got %r" % (v,))
            self._keep.append(b)
            return b

        # the options taken as they are (int, float or bool as int), then the named ones
        plain: Dict[str, Tuple[Any, Callable[[Any], Union[int, float]]]] = {
                 "tp": (tp, int), "cp": (cp, int), "dp_replicate": (dp_replicate, int),
                 "sequence_parallel": (sequence_parallel, _bool_int), "zero": (zero, int),
                 "prefetch_forward": (prefetch_forward, int),
                 "prefetch_backward": (prefetch_backward, int),
                 "cpu_offload": (cpu_offload, _bool_int), "lr": (lr, float),
                 "min_lr": (min_lr, float), "eps": (eps, float),
                 "weight_decay": (weight_decay, float), "warmup_steps": (warmup_steps, int),
                 "total_steps": (total_steps, int), "max_grad_norm": (max_grad_norm, float),
                 "micro_batch_tokens": (micro_batch_tokens, int),
                 "unshard_for_inference": (unshard_for_inference, _bool_int),
                 "batch_invariant": (batch_invariant, _bool_int), "ep": (ep, int),
                 "lora_rank": (lora_rank, int), "lora_alpha": (lora_alpha, float),
                 "lora_dropout": (lora_dropout, float),
                 "lora_use_rslora": (lora_use_rslora, _bool_int), "lora_seed": (lora_seed, int),
                 "inference_only": (inference_only, _bool_int)}
        for field, (value, kind) in plain.items():
            if value is not None:
                setattr(o, field, kind(value))
        if device is not None:
            o.device = cstr(device)
        if parallel_plan is not None:
            o.parallel_plan = cstr(parallel_plan)
        if freeze is not None:
            o.freeze = cstr(freeze if isinstance(freeze, (str, bytes)) else ",".join(freeze))
        if lora_targets is not None:
            o.lora_targets = cstr(lora_targets if isinstance(lora_targets, (str, bytes))
                                  else ",".join(lora_targets))
        if adapter is not None:
            o.adapter = cstr(adapter)
        if fp32_params is not None:
            o.fp32_params = cstr(fp32_params if isinstance(fp32_params, (str, bytes))
                                 else ",".join(fp32_params))
        for field, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype),
                             ("output_dtype", output_dtype)):
            if value is not None:
                setattr(o, field, _choice(_DTYPES, value, field, exclude=("source",)))
        if reshard_after_forward is not None:
            o.reshard_after_forward = _choice(_RESHARD, _bool_word(reshard_after_forward, "true",
                                                                   "false"),
                                              "reshard_after_forward")
        if activation_checkpointing is not None:
            o.ac = _choice(_AC, _bool_word(activation_checkpointing, "full", "none"),
                           "activation_checkpointing")
        if schedule is not None:
            o.schedule = _choice(_SCHEDULES, schedule, "schedule")
        if grad_norm_type is not None:
            o.grad_norm_type = _choice(_NORMS, str(grad_norm_type), "grad_norm_type")
        if betas is not None:
            o.beta1, o.beta2 = (float(b) for b in betas)
        if comm is None:
            comm_f = -1
        elif isinstance(comm, int):
            comm_f = comm
        else:
            comm_f = int(comm.py2f())  # mpi4py
        self._options = o
        self.model_dir = os.fspath(model_dir)
        s = c_void_p()
        rc = lib.meshlm_open_f(cstr(model_dir), byref(o), comm_f, byref(s))
        if rc != 0:
            msg = (lib.meshlm_error(s) or b"").decode("utf-8", "replace") if s.value else \
                "meshlm_open: out of memory"
            if s.value:
                lib.meshlm_close(s)  # not collective: the session did not open
            raise MeshlmError(msg or "meshlm_open failed")
        self._s = s
        L._open_sessions.append(self)
        self._info = self._get_info()
        if reference:
            self.set_reference()

    # --- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """COLLECTIVE. Free the session (its shards, optimizer state, generation
        replica).  Closing twice is a no-op; any other method then raises."""
        if self._s is None:
            return
        s, self._s = self._s, None
        if self in L._open_sessions:
            L._open_sessions.remove(self)
        self._lib.meshlm_close(s)

    def __enter__(self) -> Policy:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False

    def __del__(self) -> None:
        # Closing is collective: only a one-rank session is closed by the
        # garbage collector (ranks need not collect at the same point); the
        # others are closed at exit.
        try:
            if self._s is not None and self._info is not None and self._info["world"] == 1:
                self.close()
        except Exception:
            pass

    @property
    def closed(self) -> bool:
        return self._s is None

    def __repr__(self) -> str:
        if self._s is None:
            return "<meshlm.Policy %r closed>" % (self.model_dir,)
        i = self.info
        return ("<meshlm.Policy %r rank %d/%d dp_replicate=%d dp_shard=%d cp=%d tp=%d step=%d>"
                % (self.model_dir, i["rank"], i["world"], i["dp_replicate"], i["dp_shard"],
                   i["cp"], i["tp"], i["step"]))

    # --- helpers --------------------------------------------------------------------------------

    def _session(self) -> c_void_p:
        if self._s is None:
            raise MeshlmError("meshlm: the policy is closed")
        return self._s

    def _error(self) -> str:
        return str((self._lib.meshlm_error(self._s) or b"").decode("utf-8", "replace"))

    def _check(self, rc: int, call: str) -> None:
        if rc != 0:
            msg = self._error() or "%s failed" % call
            m = _POISON_RE.search(msg)
            if m:  # another rank's arguments were refused by its binding (_poison_seqs)
                msg = ("%s: rank %d's arguments were wrong (its error says which); the call "
                       "failed on every rank" % (call, int(m.group(1)) - _POISON_BASE))
            raise MeshlmError(msg)

    def _world(self) -> int:
        return self._info["world"] if self._info else 1

    def _rank(self) -> int:
        return self._known_info()["rank"]

    def _known_info(self) -> PolicyInfo:
        if self._info is None:  # only before __init__ has finished
            raise MeshlmError("meshlm: the policy did not open")
        return self._info

    def _get_info(self) -> PolicyInfo:
        i = L.meshlm_info()
        self._check(self._lib.meshlm_get_info(self._session(), byref(i)), "meshlm_get_info")
        # (the dict also has the struct's struct_size, which PolicyInfo leaves undeclared)
        return cast(PolicyInfo, {name: getattr(i, name) for name, *_ in L.meshlm_info._fields_})

    def _arg_error(self, err: _ArgError, poison: Callable[[], None]) -> NoReturn:
        """Raise an argument error found before a collective call; with more
        than one rank, first make the call fail on every rank (poison)."""
        if self._world() > 1:
            poison()
        raise MeshlmError(str(err)) from None

    # --- information ------------------------------------------------------------------------------

    @property
    def info(self) -> PolicyInfo:
        """This rank's place and the model (meshlm_info), a dict: rank, world,
        dp_replicate, dp_shard, cp, tp, dp_rank, dp_size, cp_rank, tp_rank,
        vocab_size, hidden_size, num_layers, num_params, bos_token_id,
        eos_token_id (-1: none), step (optimizer steps taken), max_seq_len (the
        longest sequence the model takes, in tokens).  Not collective."""
        self._info = self._get_info()
        return self._info.copy()

    def weights(self) -> List[Tuple[str, Tuple[int, ...], str]]:
        """The model's HF tensors in refit order: a list of (name, shape tuple,
        source dtype "fp32" | "bf16").  Not collective."""
        s = self._session()
        n = self._lib.meshlm_num_weights(s)
        if n < 0:
            raise MeshlmError(self._error())
        out: List[Tuple[str, Tuple[int, ...], str]] = []
        w = L.meshlm_weight()
        for i in range(n):
            self._check(self._lib.meshlm_weight_info(s, i, byref(w)), "meshlm_weight_info")
            out.append((w.name.decode(), tuple(int(w.shape[d]) for d in range(w.ndim)),
                        _DTYPE_NAMES[w.dtype]))
        return out

    def last_call_stats(self) -> CallStats:
        """What the last logprobs() or train_step() did on this rank
        (meshlm_last_call_stats), a dict: micro_batches, tokens (positions
        computed, padding included), padding, fsdp_all_gathers,
        fsdp_reduce_scatters, fsdp_all_reduces, fsdp_bytes, tp_collectives,
        cp_collectives, dp_replicate_collectives, nonfinite_logprobs (logprobs:
        returned log-probs that are not finite), preemptions (generate: the
        sequences preempted for want of KV blocks; generate() zeroes the
        others).  Not collective."""
        s = self._session()
        st = L.meshlm_call_stats()
        self._check(self._lib.meshlm_last_call_stats(s, byref(st)), "meshlm_last_call_stats")
        return cast(CallStats, {name: int(getattr(st, name))
                                for name, *_ in L.meshlm_call_stats._fields_})

    # --- scoring ----------------------------------------------------------------------------------

    @overload
    def logprobs(self, seqs: TokenSeqs, mask: Optional[PerToken] = None,
                 return_entropy: Literal[False] = False
                 ) -> Tuple[List[NDArray[np.float32]], NDArray[np.float64]]: ...

    @overload
    def logprobs(self, seqs: TokenSeqs, mask: Optional[PerToken] = None, *,
                 return_entropy: Literal[True]
                 ) -> Tuple[List[NDArray[np.float32]], NDArray[np.float64],
                            List[NDArray[np.float32]]]: ...

    def logprobs(self, seqs: TokenSeqs, mask: Optional[PerToken] = None,
                 return_entropy: bool = False
                 ) -> Union[Tuple[List[NDArray[np.float32]], NDArray[np.float64]],
                            Tuple[List[NDArray[np.float32]], NDArray[np.float64],
                                  List[NDArray[np.float32]]]]:
        """COLLECTIVE. Per-token log-probs of this rank's sequences.

        seqs: list of n 1-D integer arrays (lengths L_k >= 1), token ids.
        mask: None (all) or prediction-aligned 0/1 (list of arrays of len
            L_k - 1, or one array of sum(L_k - 1)); where 0 the log-prob is 0
            and left out of the sums.  Another value raises MeshlmError.
        return_entropy: also return each position's entropy (verl's
            compute_log_prob(calculate_entropy=True)).
        Returns (lps, sums), or (lps, sums, entropies) with return_entropy:
        lps a list of n float32 arrays of len L_k - 1, lps[k][t] = log
        p(seqs[k][t+1] | seqs[k][:t+1]); sums a float64 array [n], the sum of
        each sequence's (masked) entries; entropies like lps, entropies[k][t] =
        -sum_v p_v log p_v (nats) of the distribution lps[k][t] is read from,
        computed vocab-parallel (meshlm_score; 0 where masked).  Log-probs
        that are not finite (NaN or inf, from weights or activations that
        overflowed) are returned as they are, with one warning
        (warnings.warn) counting them and naming the first
        (last_call_stats()["nonfinite_logprobs"])."""
        lps, sums, ent = self._score("meshlm_logprobs", seqs, mask, return_entropy)
        return (lps, sums, ent) if ent is not None else (lps, sums)

    def set_reference(self) -> None:
        """COLLECTIVE. Capture the current weights as the reference policy
        (the KL penalty's pi_ref; NeMo RL's reference model): a frozen copy of
        this rank's FSDP shards in fp32 (4 bytes per parameter over the ranks
        sharing them), no gradient, no optimizer state.  Right after opening
        (or Policy(reference=True)) it is the initial policy; a later call
        moves it to the weights of that moment (meshlm_set_reference)."""
        s = self._session()
        self._check(self._lib.meshlm_set_reference(s), "meshlm_set_reference")

    def reference_logprobs(self, seqs: TokenSeqs, mask: Optional[PerToken] = None
                           ) -> Tuple[List[NDArray[np.float32]], NDArray[np.float64]]:
        """COLLECTIVE. logprobs() computed with the reference policy's
        weights (set_reference), as NeMo RL's get_reference_policy_logprobs:
        bitwise those of a Policy opened on the captured weights with the same
        options; the policy itself is left as it was.  Raises MeshlmError
        when no reference was captured."""
        lps, sums, _ = self._score("meshlm_reference_logprobs", seqs, mask, False)
        return lps, sums

    def _score(self, fn: str, seqs: TokenSeqs, mask: Optional[PerToken], return_entropy: bool
               ) -> Tuple[List[NDArray[np.float32]], NDArray[np.float64],
                          Optional[List[NDArray[np.float32]]]]:
        """logprobs / reference_logprobs through `fn` (meshlm_score where the
        entropies are asked for): (lps, sums, entropies or None)."""
        call = "meshlm_score" if return_entropy else fn
        s = self._session()
        try:
            b = _Batch(seqs)
            m = b.per_token(mask, "mask", np.uint8)
        except _ArgError as e:
            self._arg_error(e, lambda: self._poison_logprobs(s, call))
        out = np.zeros(b.total, np.float32)
        sums = np.zeros(b.n, np.float64)
        ent = np.zeros(b.total, np.float32) if return_entropy else None
        if return_entropy:
            req = L.meshlm_scores(logprobs=_ptr(out, c_float), seq_sums=_ptr(sums, c_double),
                                  entropy=_ptr(ent, c_float))
            rc = self._lib.meshlm_score(s, byref(b.c), _ptr(m, c_uint8), byref(req))
            self._check(rc, "meshlm_score")
        else:
            rc = getattr(self._lib, fn)(s, byref(b.c), _ptr(m, c_uint8), _ptr(out, c_float),
                                        _ptr(sums, c_double))
            self._check(rc, fn)
        bad = self.last_call_stats()["nonfinite_logprobs"]
        if bad:
            k, t = b.locate(int(np.flatnonzero(~np.isfinite(out))[0]))
            warnings.warn("logprobs: %d log-probs are not finite (NaN or inf) on rank %d, the "
                          "first at sequence %d, entry %d" % (bad, self._rank(), k, t),
                          stacklevel=3)
        return b.split(out), sums, (b.split(ent) if ent is not None else None)


    def topk_logprobs(self, seqs: TokenSeqs, k: int, mask: Optional[PerToken] = None
                      ) -> Tuple[List[NDArray[np.int32]], List[NDArray[np.float32]]]:
        """COLLECTIVE. The k most probable next tokens at each position of
        this rank's sequences (NeMo RL's get_topk_logits, next-token
        aligned, as log-probs).

        seqs, mask: as logprobs (where the mask is 0 the ids are -1 and the
            log-probs 0).
        k: 0 <= k <= vocab_size.
        Returns (ids, lps): two lists of n arrays of shape (L_k - 1, k), int32
        token ids and their float32 log-probs, best first in the logits'
        order (equal logits: the lower id first; log-probs non-increasing),
        merged over the vocab-parallel ranks so that no rank holds
        full-vocabulary logits; an id's log-prob is bitwise the one logprobs
        gives it as the next token.  k out of range, or k > 0
        under context parallelism (cp > 1, not implemented), raises
        MeshlmError."""
        s = self._session()
        try:
            b = _Batch(seqs)
            m = b.per_token(mask, "mask", np.uint8)
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
                raise _ArgError("k: expected an int, got %s" % type(k).__name__)
            if not 0 <= k <= _INT32_MAX:
                raise _ArgError("k: %d; expected 0 <= k <= vocab_size" % k)
        except _ArgError as e:
            self._arg_error(e, lambda: self._poison_logprobs(s, "meshlm_score"))
        ids = np.zeros((b.total, int(k)), np.int32)
        lps = np.zeros((b.total, int(k)), np.float32)
        req = L.meshlm_scores(topk=int(k), topk_logprobs=_ptr(lps, c_float),
                              topk_ids=_ptr(ids, c_int32))
        self._check(self._lib.meshlm_score(s, byref(b.c), _ptr(m, c_uint8), byref(req)),
                    "meshlm_score")
        return b.split(ids), b.split(lps)

    def routing(self, seqs: TokenSeqs) -> List[NDArray[np.int32]]:
        """COLLECTIVE. Router replay's record (Megatron-LM's R3;
        meshlm_scores.routing): the experts each sparse layer of a
        mixture-of-experts model chooses for every token of this rank's
        sequences, in one scoring pass.  Returns a list of n int32 arrays of
        shape (L_k, num_hidden_layers, num_experts_per_tok), torch.topk's
        order, -1 at dense layers; train_step / forward_backward / eval_loss
        take them as routing=.  A model without experts, or cp > 1, raises
        MeshlmError."""
        s = self._session()
        try:
            b = _Batch(seqs)
        except _ArgError as e:
            self._arg_error(e, lambda: self._poison_logprobs(s, "meshlm_score"))
        layers, k = self._routing_shape()
        out = np.zeros((int(b.lens.sum()), layers, k), np.int32)
        lp = np.zeros(max(b.total, 1), np.float32)
        # a dense model's k is 0: a non-empty buffer still, so that the library refuses it
        buf = out if out.size else np.zeros(1, np.int32)
        req = L.meshlm_scores(logprobs=_ptr(lp, c_float), routing=_ptr(buf, c_int32))
        self._check(self._lib.meshlm_score(s, byref(b.c), None, byref(req)), "meshlm_score")
        return np.split(out, np.cumsum(b.lens)[:-1]) if b.n else []

    def _routing_shape(self) -> Tuple[int, int]:
        """(num_hidden_layers, num_experts_per_tok) of the model (0 experts: 0)."""
        with open(os.path.join(self.model_dir, "config.json")) as f:
            cfg = json.load(f)
        cfg = cfg.get("text_config", cfg)
        return int(self.info["num_layers"]), int(cfg.get("num_experts_per_tok") or 0)

    def _routing_in(self, b: _Batch, x: Optional[ArrayLike]) -> Optional[NDArray[np.int32]]:
        """A routing= argument (per-sequence arrays or one array) as one
        contiguous int32 array (sum(L_k), layers, k), shapes checked."""
        if x is None:
            return None
        layers, k = self._routing_shape()
        parts = [as_numpy(e) for e in x] if isinstance(x, (list, tuple)) else [as_numpy(x)]
        if isinstance(x, (list, tuple)):
            if len(parts) != b.n:
                raise _ArgError("routing: %d per-sequence arrays for %d sequences"
                                % (len(parts), b.n))
            for q, e in enumerate(parts):
                if e.shape != (int(b.lens[q]), layers, k):
                    raise _ArgError("routing[%d]: shape %s; expected (%d, %d, %d): (tokens, "
                                    "num_hidden_layers, num_experts_per_tok)"
                                    % (q, e.shape, int(b.lens[q]), layers, k))
        a = np.concatenate(parts) if parts else np.zeros((0, layers, k), np.int32)
        if a.shape != (int(b.lens.sum()), layers, k):
            raise _ArgError("routing: shape %s; expected (%d, %d, %d): (tokens, "
                            "num_hidden_layers, num_experts_per_tok)"
                            % (a.shape, int(b.lens.sum()), layers, k))
        if a.size and a.dtype.kind not in "iu":
            raise _ArgError("routing: expected integer expert ids, got dtype %s" % a.dtype)
        return np.ascontiguousarray(a, np.int32)

    def _poison_logprobs(self, s: c_void_p, fn: str) -> None:
        lens, toks, c = _poison_seqs(self._rank())
        out = np.zeros(1, np.float32)
        if fn == "meshlm_score":
            req = L.meshlm_scores(logprobs=_ptr(out, c_float))
            self._lib.meshlm_score(s, byref(c), None, byref(req))
        else:
            getattr(self._lib, fn)(s, byref(c), None, _ptr(out, c_float), None)

    # --- training ---------------------------------------------------------------------------------

    def train_step(self, seqs: TokenSeqs, loss: Union[str, Objective] = "nll",
                   token_mask: Optional[PerToken] = None,
                   token_weights: Optional[PerToken] = None,
                   seq_weights: Optional[ArrayLike] = None,
                   old_logprobs: Optional[PerToken] = None,
                   ref_logprobs: Optional[PerToken] = None, sequence_level: bool = False,
                   ratio_clip_min: float = 0.2, ratio_clip_max: float = 0.2,
                   ratio_clip_c: float = 0.0, kl_penalty: float = 0.0, *,
                   generation_logprobs: Optional[PerToken] = None, is_level: str = "off",
                   is_truncation: str = "none", is_ratio_min: float = 0.0,
                   is_ratio_max: float = 0.0, tensors: Optional[Mapping[str, PerToken]] = None,
                   seq_tensors: Optional[Mapping[str, ArrayLike]] = None,
                   seq_logprobs: bool = False, entropy_coef: float = 0.0,
                   routing: Optional[ArrayLike] = None) -> StepResult:
        """COLLECTIVE. One optimizer step on the global batch (every data-parallel
        rank's seqs; a rank may pass none): zero_grad, forward_backward,
        optimizer_step (bitwise their composition).

        seqs: list of n 1-D integer arrays.
        loss: "nll" (SFT), "weighted_nll" (-A_t lp_t: REINFORCE) or
            "clipped_pg" (PPO / GRPO clipped ratio; needs old_logprobs), or a
            Python objective (a callable of an ObjectiveChunk returning its
            loss terms and dL/dlogprobs: MESHLM_LOSS_CUSTOM, called per chunk
            of this rank's trained targets; it must be deterministic and
            must not call the Policy).
        token_mask, token_weights, old_logprobs, ref_logprobs,
            generation_logprobs: prediction-aligned (list of arrays of len
            L_k - 1, or one array of sum(L_k - 1)); token_mask 0/1 (None: all;
            another value raises MeshlmError), the others float32.
        seq_weights: [n] float32 per-sequence weights / advantages.
        sequence_level: normalise per sequence, then over sequences (else over
            all masked tokens of the global batch).
        ratio_clip_min/max: epsilon low / high; ratio_clip_c: dual clip (> 1) or
            0; kl_penalty: beta of the k3 KL to ref_logprobs (> 0 needs them).
        is_level ("off", "token", "sequence"), is_truncation ("none", "tis",
            "icepop", "seq-mask-tis"), is_ratio_min/max: clipped_pg's
            importance-sampling correction to generation_logprobs (NeMo RL
            ClippedPGLossFn; meshlm.h meshlm_is_level).
        tensors / seq_tensors: a Python objective's per-token (prediction
            aligned) / per-sequence ([n]) arrays, handed to it gathered at each
            chunk's targets (ObjectiveChunk.tensors).
        seq_logprobs: a Python objective gets each sequence's masked
            log-prob sum first (one more forward pass; DPO, GSPO).
        entropy_coef: c of an entropy bonus, the loss minus c times the masked
            predictions' mean entropy (normalised as the loss; its gradient
            exact, vocab-parallel; NeMo RL's entropy_loss_coeff); 0: off.
        routing: router replay of a mixture-of-experts model (routing()'s
            output: a list of n int32 arrays (L_k, num_hidden_layers,
            num_experts_per_tok), or one of sum(L_k) rows): the sparse layers
            route by these experts instead of their top-k, the gates the
            router's softmax at them (Megatron-LM's R3;
            meshlm_train_batch.routing).
        Returns a dict: loss, kl, clip_fraction, grad_norm (before clipping), lr
        (float); tokens, sequences (global counts), step (steps taken after this
        one) (int); skipped (bool: a non-finite loss or grad norm, no update);
        nonfinite_param (str: the first parameter with a non-finite gradient,
        "" when none is); token_mult_prob_error, gen_kl_error (with
        generation_logprobs and old_logprobs), is_oob_fraction (float);
        skip_reason (str); entropy (float: with entropy_coef != 0 the masked
        predictions' mean entropy in nats, else 0)."""
        return self._loss_call("meshlm_train_step", seqs, loss, locals())

    def forward_backward(self, seqs: TokenSeqs, loss: Union[str, Objective] = "nll",
                         token_mask: Optional[PerToken] = None,
                         token_weights: Optional[PerToken] = None,
                         seq_weights: Optional[ArrayLike] = None,
                         old_logprobs: Optional[PerToken] = None,
                         ref_logprobs: Optional[PerToken] = None, sequence_level: bool = False,
                         ratio_clip_min: float = 0.2, ratio_clip_max: float = 0.2,
                         ratio_clip_c: float = 0.0, kl_penalty: float = 0.0, *,
                         generation_logprobs: Optional[PerToken] = None, is_level: str = "off",
                         is_truncation: str = "none", is_ratio_min: float = 0.0,
                         is_ratio_max: float = 0.0,
                         tensors: Optional[Mapping[str, PerToken]] = None,
                         seq_tensors: Optional[Mapping[str, ArrayLike]] = None,
                         seq_logprobs: bool = False, entropy_coef: float = 0.0,
                         routing: Optional[ArrayLike] = None) -> StepResult:
        """COLLECTIVE. Forward + backward of the loss on the global batch (the
        arguments as train_step's), the gradients added to those accumulated
        since zero_grad (meshlm_forward_backward): each call normalised by its
        own global batch, as one torch loss.backward() per call.  Returns this
        call's loss, kl, clip_fraction, tokens, sequences and metrics; skipped
        True (and skip_reason) when its loss is not finite (the next
        optimizer_step then skips)."""
        return self._loss_call("meshlm_forward_backward", seqs, loss, locals())

    def eval_loss(self, seqs: TokenSeqs, loss: Union[str, Objective] = "nll",
                  token_mask: Optional[PerToken] = None,
                  token_weights: Optional[PerToken] = None,
                  seq_weights: Optional[ArrayLike] = None,
                  old_logprobs: Optional[PerToken] = None,
                  ref_logprobs: Optional[PerToken] = None, sequence_level: bool = False,
                  ratio_clip_min: float = 0.2, ratio_clip_max: float = 0.2,
                  ratio_clip_c: float = 0.0, kl_penalty: float = 0.0, *,
                  generation_logprobs: Optional[PerToken] = None, is_level: str = "off",
                  is_truncation: str = "none", is_ratio_min: float = 0.0,
                  is_ratio_max: float = 0.0, tensors: Optional[Mapping[str, PerToken]] = None,
                  seq_tensors: Optional[Mapping[str, ArrayLike]] = None,
                  seq_logprobs: bool = False, entropy_coef: float = 0.0,
                  routing: Optional[ArrayLike] = None) -> StepResult:
        """COLLECTIVE. The loss on the global batch at the current weights,
        forward only (meshlm_eval_loss; no gradient touched).  Arguments and
        result as forward_backward's; a mixture-of-experts model with
        output_router_logits includes its load-balancing term, as training
        and transformers' forward do."""
        return self._loss_call("meshlm_eval_loss", seqs, loss, locals())

    def zero_grad(self) -> None:
        """COLLECTIVE. Zero the accumulated gradients and results
        (meshlm_zero_grad; torch optimizer.zero_grad())."""
        s = self._session()
        self._check(self._lib.meshlm_zero_grad(s), "meshlm_zero_grad")

    def optimizer_step(self) -> StepResult:
        """COLLECTIVE. Grad norm, clipping, AdamW at the schedule's lr on the
        accumulated gradients, or a skipped step (a non-finite loss since
        zero_grad, or a non-finite norm; skip_reason says which)
        (meshlm_optimizer_step).  Returns the accumulated loss and metrics of
        the forward_backward calls since zero_grad, grad_norm, lr, step,
        skipped, nonfinite_param, skip_reason."""
        s = self._session()
        r = L.meshlm_step_result()
        self._check(self._lib.meshlm_optimizer_step(s, byref(r)), "meshlm_optimizer_step")
        return _step_result(r)

    def _loss_call(self, call: str, seqs: TokenSeqs, loss: Union[str, Objective],
                   a: Dict[str, Any]) -> StepResult:
        """train_step / forward_backward / eval_loss: the arguments a (the
        method's locals) as meshlm_train_batch and meshlm_loss, then `call`."""
        s = self._session()
        try:
            b = _Batch(seqs)
            mask = b.per_token(a["token_mask"], "token_mask", np.uint8)
            arr = {k: b.per_token(a[k], k, np.float32)
                   for k in ("token_weights", "old_logprobs", "ref_logprobs",
                             "generation_logprobs")}
            sw = b.per_seq(a["seq_weights"], "seq_weights", np.float32)
            rt = self._routing_in(b, a["routing"])
            lo = L.meshlm_loss()
            self._lib.meshlm_loss_init(byref(lo), ctypes.sizeof(lo))
            obj: Optional[_ObjectiveCall] = None
            if callable(loss):
                tens = {k: cast(NDArray[Any], b.per_token(v, "tensors[%r]" % k, np.float64))
                        for k, v in (a["tensors"] or {}).items()}
                stens = {k: cast(NDArray[Any], b.per_seq(v, "seq_tensors[%r]" % k, np.float64))
                         for k, v in (a["seq_tensors"] or {}).items()}
                obj = _ObjectiveCall(cast(Objective, loss), b.n, tens, stens)
                lo.kind = L.LOSS_CUSTOM
                lo.objective = obj.c_fn
                lo.objective_seq_logprobs = _bool_int(a["seq_logprobs"])
            else:
                lo.kind = _choice(_LOSSES, loss, "loss")
            lo.is_level = _choice(_IS_LEVELS, a["is_level"], "is_level")
            lo.is_truncation = _choice(_IS_TRUNCATIONS, a["is_truncation"], "is_truncation")
        except _ArgError as e:
            self._arg_error(e, lambda: self._poison_train(s, call))
        tb = L.meshlm_train_batch(b.c, _ptr(mask, c_uint8), _ptr(arr["token_weights"], c_float),
                                  _ptr(sw, c_float), _ptr(arr["old_logprobs"], c_float),
                                  _ptr(arr["ref_logprobs"], c_float),
                                  _ptr(arr["generation_logprobs"], c_float), _ptr(rt, c_int32))
        lo.sequence_level = _bool_int(a["sequence_level"])
        for k in ("ratio_clip_min", "ratio_clip_max", "ratio_clip_c", "kl_penalty",
                  "is_ratio_min", "is_ratio_max", "entropy_coef"):
            setattr(lo, k, float(a[k]))
        r = L.meshlm_step_result()
        rc = getattr(self._lib, call)(s, byref(tb), byref(lo), byref(r))
        if rc != 0 and obj is not None and obj.error is not None:
            raise MeshlmError("%s: the objective raised %s: %s"
                              % (call, type(obj.error).__name__, obj.error)) from obj.error
        self._check(rc, call)
        return _step_result(r)

    def _poison_train(self, s: c_void_p, call: str = "meshlm_train_step") -> None:
        lens, toks, c = _poison_seqs(self._rank())
        tb = L.meshlm_train_batch(c, None, None, None, None, None, None)
        r = L.meshlm_step_result()
        getattr(self._lib, call)(s, byref(tb), None, byref(r))

    # --- checkpoints --------------------------------------------------------------------------------

    def save(self, dir: StrPath) -> None:
        """COLLECTIVE. Write a run checkpoint (sharded weights, AdamW state, the
        step) under dir, committed atomically (`meshlm train --save`'s format)."""
        self._check(self._lib.meshlm_save(self._session(), os.fsencode(dir)), "meshlm_save")

    def resume(self, dir: StrPath) -> None:
        """COLLECTIVE. Load the latest run checkpoint in dir (any mesh's)."""
        self._check(self._lib.meshlm_resume(self._session(), os.fsencode(dir)), "meshlm_resume")
        self._info = self._get_info()

    def export(self, dir: StrPath, dtype: str = "source", merge_lora: bool = False) -> None:
        """COLLECTIVE. Write the current weights as an HF checkpoint in dir
        (config.json, tokenizer and untrained tensors of the source carried
        over), trained tensors in dtype: "source", "fp32" or "bf16".  A LoRA
        policy writes its PEFT adapter directory, or with merge_lora=True the
        merged model (W + scaling*B*A in every adapted weight, `--merge-lora`)."""
        d = _choice(_DTYPES, dtype, "dtype")
        if merge_lora:
            self._check(self._lib.meshlm_export_merged(self._session(), os.fsencode(dir), d),
                        "meshlm_export_merged")
            return
        self._check(self._lib.meshlm_export(self._session(), os.fsencode(dir), d), "meshlm_export")

    def reload(self, dir: StrPath) -> None:
        """COLLECTIVE. Replace every weight (not the optimizer state nor the step)
        from an HF checkpoint directory with the model's shapes."""
        self._check(self._lib.meshlm_reload(self._session(), os.fsencode(dir)), "meshlm_reload")

    # --- refit ----------------------------------------------------------------------------------------

    def _receives(self, root: int) -> bool:
        return root < 0 or self._rank() == root

    def refit(self, root: int = 0, dtype: str = "source",
              lora: Optional[str] = None) -> Optional[Dict[str, WeightArray]]:
        """COLLECTIVE. The current weights, full, in HF names (what NeMo RL's
        refit hands to vLLM): a dict name -> numpy array (shape of the HF
        tensor) on the receiving rank(s) -- rank root of the session, or every
        rank when root < 0 -- and None on the others.  dtype: "source" (each
        tensor in the source checkpoint's dtype), "fp32" or "bf16"; float32
        arrays for fp32, uint16 raw bits for bf16 (bf16_to_f32 converts).
        Byte-equal to what export(dir, dtype) writes.  lora (a LoRA policy):
        "adapters" -- the adapters alone under PEFT's keys
        (base_model.model.<name>, what vLLM's LoRA loading takes), or
        "merged" -- the base tensors with W + scaling*B*A merged into each
        adapted weight, byte-equal to export(dir, dtype, merge_lora=True);
        None: every parameter, adapters beside the base (meshlm_refit)."""
        if lora is not None:
            got: Dict[str, WeightArray] = {}
            self.refit_stream(lambda name, a: got.__setitem__(name, a), root, dtype, lora=lora)
            return got if self._receives(int(root)) else None
        s = self._session()
        d = _choice(_DTYPES, dtype, "dtype")
        root = int(root)
        out: Optional[Dict[str, WeightArray]] = None
        bufs = None
        if self._receives(root):
            out = {}
            arrays: List[WeightArray] = []
            for name, shape, src in self.weights():
                td = _DTYPES[src] if d == L.DTYPE_SOURCE else d
                a = cast(WeightArray, np.empty(shape, _np_dtype(td)))
                out[name] = a
                arrays.append(a)
            bufs = (c_void_p * max(len(arrays), 1))(*[a.ctypes.data for a in arrays])
        self._check(self._lib.meshlm_refit_into(s, root, d, bufs), "meshlm_refit_into")
        return out

    def refit_stream(self, fn: Callable[[str, WeightArray], object], root: int = 0,
                     dtype: str = "source", copy: bool = True,
                     lora: Optional[str] = None) -> None:
        """COLLECTIVE. Stream the current weights one full tensor at a time
        (refit order) to rank root (every rank when root < 0): on the receiving
        rank(s) fn(name, array) is called per tensor, array float32 or uint16
        (bf16 bits) of the HF shape.  copy=False passes a read-only view of the
        library's buffer, valid only during the call (copy it to keep it).
        fn returning False, or raising, stops the refit: every rank raises
        MeshlmError, and the raising rank re-raises fn's exception.  The
        receiver holds one full tensor at a time beyond its shards.  lora: as
        refit's ("adapters", "merged"; merged weights are merged one tensor at a
        time as they stream)."""
        s = self._session()
        d = _choice(_DTYPES, dtype, "dtype")
        view = None if lora is None else _choice(_LORA_VIEWS, lora, "lora")
        failure: List[BaseException] = []

        def tramp(ctx: Optional[int], name: bytes, dt: int, ndim: int, shape: Any,
                  data: Optional[int], nbytes: int) -> int:
            try:
                shp = tuple(int(shape[i]) for i in range(ndim))
                npd = _np_dtype(dt)
                buf: Any = (ctypes.c_char * nbytes).from_address(cast(int, data)) if nbytes else b""
                a = cast(WeightArray, np.frombuffer(buf, dtype=npd).reshape(shp))
                if copy:
                    a = a.copy()
                else:
                    a.flags.writeable = False
                return 1 if fn(name.decode(), a) is False else 0
            except BaseException as e:  # stop the refit, re-raise after it
                failure.append(e)
                return 1

        cb = L.meshlm_tensor_fn(tramp)  # kept alive for the call by this local
        if view is None:
            rc, call = self._lib.meshlm_refit(s, int(root), d, cb, None), "meshlm_refit"
        else:
            call = "meshlm_refit_lora"
            rc = self._lib.meshlm_refit_lora(s, int(root), d, view, cb, None)
        if failure:
            raise failure[0]
        self._check(rc, call)

    def reload_tensors(self, tensors: Mapping[str, ArrayLike]) -> None:
        """COLLECTIVE. Replace the given weights from memory (not the optimizer
        state nor the step): tensors a dict (any Mapping) HF name -> full
        numpy array of the HF shape, float32 (other float dtypes are converted)
        or uint16 bf16 bits; a torch tensor (host memory, zero-copy through
        DLPack; torch.bfloat16 as bf16) or an ml_dtypes.bfloat16 array too.  Every rank passes the same tensors; others stay
        as they are."""
        s = self._session()
        items: List[Tuple[bytes, int, NDArray[Any]]] = []
        try:
            if not isinstance(tensors, _MappingABC):
                raise _ArgError("reload_tensors: expected a dict name -> array, got %s"
                                % type(tensors).__name__)
            for name, a in tensors.items():
                a = as_numpy(a)  # a torch / ml_dtypes bf16 tensor: its uint16 bits
                if a.dtype == np.uint16:
                    dt = L.DTYPE_BF16
                elif a.dtype.kind == "f":
                    dt = L.DTYPE_F32
                    a = a.astype(np.float32, copy=False)
                else:
                    raise _ArgError("reload_tensors: %s: dtype %s, expected float32 or uint16 "
                                    "(bf16 bits)" % (name, a.dtype))
                if a.ndim not in (1, 2):
                    raise _ArgError("reload_tensors: %s: %d dimensions, expected 1 or 2"
                                    % (name, a.ndim))
                items.append((os.fsencode(name), dt, np.ascontiguousarray(a)))
        except _ArgError as e:
            self._arg_error(e, lambda: self._poison_reload(s))
        arr = (L.meshlm_tensor * max(len(items), 1))()  # no __init__: struct_size set below
        for i, (bname, dt, c) in enumerate(items):
            t = arr[i]
            t.struct_size = ctypes.sizeof(t)
            t.name, t.dtype, t.ndim = bname, dt, c.ndim
            for dim in range(c.ndim):
                t.shape[dim] = c.shape[dim]
            t.data = c.ctypes.data
        self._check(self._lib.meshlm_reload_tensors(s, len(items), arr),
                    "meshlm_reload_tensors")

    def _poison_reload(self, s: c_void_p) -> None:
        arr = (L.meshlm_tensor * 1)()
        arr[0].struct_size = ctypes.sizeof(arr[0])
        one = np.zeros(1, np.float32)
        name = b"(rank %d's tensors were refused by its binding)" % self._rank()
        arr[0].name, arr[0].dtype, arr[0].ndim = name, L.DTYPE_F32, 1
        arr[0].shape[0] = 1
        arr[0].data = one.ctypes.data
        self._lib.meshlm_reload_tensors(s, 1, arr)

    # --- generation ------------------------------------------------------------------------------------

    def generate(self, prompts: TokenSeqs, max_new_tokens: Union[int, Sequence[int]] = 32,
                 temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
                 eos_token_id: int = -1, seed: int = 0, n: int = 1, top_k: int = 0,
                 min_p: float = 0.0, stop: Optional[Sequence[int]] = None,
                 max_running: int = 0, prefill_tokens: int = 0, replica: bool = False,
                 max_kv_bytes: int = 0
                 ) -> Tuple[List[NDArray[np.int32]], List[NDArray[np.float32]], List[str]]:
        """COLLECTIVE (each data-parallel rank samples its own prompts; their
        number may differ and be 0). Continue each prompt with n samples of up to
        max_new_tokens sampled tokens (meshlm_generate_samples: every
        sequence decodes together over a KV cache, continuous batching, on the
        policy's mesh or, with replica, on a replica of the current weights).

        prompts: list of P 1-D integer arrays.
        max_new_tokens: 1 .. info["max_seq_len"] - the longest prompt's length
            (checked before the outputs are allocated); or a list of P, each
            prompt's own.
        temperature > 0, top_k >= 0 (0: off), top_p in (0, 1] (nucleus),
            min_p in [0, 1] (0: off), applied in that order as transformers'
            warpers; greedy: argmax.
        eos_token_id: stop a sequence after it; -1: the model's (config.json),
            -2: none.  stop: more stop ids.  seed: same seed, same tokens.
        n: samples per prompt (GRPO's group; the prompt is prefilled once).
        max_running: sequences decoding at once (>= n; 0: all, at most 256);
            prefill_tokens: prompt tokens per forward (0: 512).
        replica: False (default): generate on the policy's own mesh and weights
            (refit-free; the tp ranks of a data-parallel rank decode together
            and must pass the same prompts and arguments; cp > 1 refused);
            True: on a one-rank replica per rank (each rank its own prompts).
        max_kv_bytes: the paged KV cache's bytes a rank (>= 0; prompts enter on
            the blocks they need now, a sequence finding none preempts the
            last-arrived one, which re-enters later with the same outputs:
            last_call_stats()["preemptions"]; 0: room for max_running sequences).
        Returns (tokens, logprobs, finish): lists of P·n entries, entry k·n + j
        sample j of prompt k: tokens int32 of the generated ids (the stop id
        included), logprobs float32 of the same length, log p of each
        generated token at temperature 1 (the distribution logprobs()
        scores), finish "stop" (a stop id) or "length" (max_new_tokens)."""
        s = self._session()
        try:
            b = _Batch(prompts, "prompts")
            per = None if isinstance(max_new_tokens, (int, np.integer)) else \
                np.ascontiguousarray(max_new_tokens, dtype=np.int64)
            if per is not None and per.shape != (b.n,):
                raise _ArgError("generate: max_new_tokens has %d entries; expected one per "
                                "prompt (%d) or an int" % (per.size, b.n))
            w = max(int(max_new_tokens) if per is None else int(per.max(initial=1)), 0)
            longest = int(b.lens.max()) if b.n else 1
            room = self._known_info()["max_seq_len"] - longest
            if w > room:
                raise _ArgError("generate: max_new_tokens %d; expected at most %d "
                                "(info['max_seq_len'] %d - the longest prompt's %d tokens)"
                                % (w, room, self._known_info()["max_seq_len"], longest))
            stops = np.ascontiguousarray([] if stop is None else stop, dtype=np.int32)
        except _ArgError as e:
            self._arg_error(e, lambda: self._poison_generate(s))
        sp = L.meshlm_sampling()
        self._lib.meshlm_sampling_init(byref(sp), ctypes.sizeof(sp))
        sp.max_new_tokens = int(max_new_tokens) if per is None else w
        sp.temperature = float(temperature)
        sp.top_p = float(top_p)
        sp.greedy = int(bool(greedy))
        sp.eos_token_id = int(eos_token_id)
        sp.seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        sp.n = int(n)
        sp.top_k = int(top_k)
        sp.min_p = float(min_p)
        sp.n_stop = stops.size
        sp.stop_token_ids = stops.ctypes.data_as(POINTER(c_int32))
        if per is not None:
            sp.max_new_tokens_per = per.ctypes.data_as(POINTER(c_int64))
        sp.max_running = int(max_running)
        sp.prefill_tokens = int(prefill_tokens)
        sp.replica = int(bool(replica))
        sp.max_kv_bytes = int(max_kv_bytes)
        rows = b.n * max(int(n), 0)
        toks = np.full((rows, w), -1, np.int32)
        lens = np.zeros(rows, np.int64)
        lps = np.zeros((rows, w), np.float32)
        fin = np.zeros(rows, np.int32)
        rc = self._lib.meshlm_generate_samples(s, byref(b.c), byref(sp),
                                               toks.ctypes.data_as(POINTER(c_int32)),
                                               lens.ctypes.data_as(POINTER(c_int64)),
                                               lps.ctypes.data_as(POINTER(c_float)),
                                               fin.ctypes.data_as(POINTER(c_int32)))
        self._check(rc, "meshlm_generate_samples")
        why = {1: "stop", 2: "length"}
        return ([toks[r, :lens[r]].copy() for r in range(rows)],
                [lps[r, :lens[r]].copy() for r in range(rows)],
                [why[int(f)] for f in fin])

    def _poison_generate(self, s: c_void_p) -> None:
        lens, toks, c = _poison_seqs(self._rank())
        sp = L.meshlm_sampling()
        self._lib.meshlm_sampling_init(byref(sp), ctypes.sizeof(sp))
        sp.max_new_tokens = 1
        out_t = np.zeros(1, np.int32)
        out_l = np.zeros(1, np.int64)
        self._lib.meshlm_generate(s, byref(c), byref(sp), out_t.ctypes.data_as(POINTER(c_int32)),
                                  out_l.ctypes.data_as(POINTER(c_int64)), None)
