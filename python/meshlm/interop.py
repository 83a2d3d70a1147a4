"""Arrays in and out of the binding without copies: any object that speaks
DLPack (a torch CPU tensor, a JAX or CuPy host array) is read through
np.from_dlpack, and results go to torch through torch.from_dlpack (DLPack:
the array API standard's interchange protocol).  torch and ml_dtypes are
never required: each is used only where the caller hands over, or asks for,
its type.

bf16: numpy has no bfloat16, so the library's bf16 tensors travel as their
uint16 bit patterns (refit, reload_tensors).  to_torch turns such bits into
a torch.bfloat16 view, bf16_array into an ml_dtypes.bfloat16 view where
ml_dtypes is installed; as_numpy turns a torch.bfloat16 tensor or an
ml_dtypes.bfloat16 array back into the bits.  Every conversion is a view:
the result shares the input's memory."""

import sys
from typing import Any

import numpy as np
from numpy.typing import NDArray


def _is_bf16_name(dtype: object) -> bool:
    return str(dtype) in ("bfloat16", "torch.bfloat16")


def as_numpy(x: Any) -> Any:
    """x as numpy, zero-copy where x is already an array in host memory: an
    ndarray as it is (an ml_dtypes.bfloat16 one as its uint16 bits); an
    object with __dlpack__ through np.from_dlpack (a torch.bfloat16 tensor
    as its uint16 bits); anything else (lists, scalars, objects with
    __array__) through np.asarray.  A tensor on a device (CUDA) raises
    TypeError naming its device: copy it to the host first (t.cpu())."""
    if isinstance(x, np.ndarray):
        return x.view(np.uint16) if _is_bf16_name(x.dtype) else x
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type = int(x.__dlpack_device__()[0])
        if device_type not in (1, 3):  # kDLCPU, kDLCUDAHost (pinned host memory)
            raise TypeError("a %s on DLPack device type %d; expected host memory (copy it to "
                            "the host first, e.g. tensor.cpu())"
                            % (type(x).__name__, device_type))
        if _is_bf16_name(getattr(x, "dtype", None)) and "torch" in sys.modules:
            x = x.view(sys.modules["torch"].int16)  # numpy has no bf16: its bits
            return np.from_dlpack(x).view(np.uint16)
        return np.from_dlpack(x)
    return np.asarray(x)


def to_torch(x: Any, bf16_bits: bool = False) -> Any:
    """x with every numpy array in it (x itself, or the values of lists,
    tuples and dicts, recursively) as a torch tensor sharing its memory
    (torch.from_dlpack; a read-only array is copied first); bf16_bits: uint16 arrays are bf16 bit patterns (a
    refit's bf16 tensors) and become torch.bfloat16 views.  Other values
    pass through.  Needs torch (ImportError otherwise)."""
    import torch

    if isinstance(x, np.ndarray):
        # numpy exports no read-only array through DLPack: those (refit_stream's views) are copied
        t = torch.from_dlpack(x if x.flags.writeable else np.array(x))
        return t.view(torch.bfloat16) if bf16_bits and x.dtype == np.uint16 else t
    if isinstance(x, dict):
        return {k: to_torch(v, bf16_bits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_torch(v, bf16_bits) for v in x)
    return x


def bf16_array(bits: NDArray[np.uint16]) -> Any:
    """uint16 bf16 bits as an ml_dtypes.bfloat16 array sharing their memory
    where ml_dtypes is installed; else the bits as they are (bf16_to_f32
    widens them exactly)."""
    try:
        import ml_dtypes
    except ImportError:
        return bits
    return bits.view(ml_dtypes.bfloat16)
