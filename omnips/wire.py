"""A job's wire dtype (--wire-dtype): float32 values in the form pushes and push replies
carry them, and back to float32.

Servers keep float32 master values and optimizer state; only the gradients pushed and
the shards that answer them travel narrowed. bfloat16 has no numpy dtype: its items
travel as uint16 bit patterns (the high half of a float32). Conversions write into
buffers the caller allocated once, so a step allocates nothing; they are torch's
vectorised casts, which round to nearest even, keep NaN a NaN and turn what lies
beyond the narrow type's range into inf (a non-finite gradient, never applied).
"""

import numpy as np
import torch

from . import protocol
from .flat import aligned_empty, all_finite
from .job import WIRE_DTYPES

TAGS = dict(zip(WIRE_DTYPES, ("f4", "bf16", "f2")))  # --wire-dtype -> the data header's "dt"
# float16's smallest float32 magnitude that rounds to inf: halfway past 65504, whose
# significand is odd, so the tie goes up. bfloat16 has float32's exponent range: a vector
# that all_finite accepts (square sum < 3.4e38, so every |x| < 1.9e19) cannot overflow it.
_F16_OVERFLOW = 65520.0


class WireDtype:
    def __init__(self, name: str):
        if name not in TAGS:
            raise ValueError(f"wire dtype must be one of {', '.join(TAGS)}, not {name!r}")
        self.name = name
        self.tag = TAGS[name]
        self.dtype = protocol.DTYPES[self.tag]  # the items' numpy dtype on the wire
        self.exact = name == "float32"  # float32 travels as it is: no buffer, no conversion

    def __repr__(self):
        return f"WireDtype({self.name!r})"

    def buffer(self, n: int) -> np.ndarray | None:
        """A page-aligned buffer for `n` wire values (None for float32: values travel as they are)."""
        return None if self.exact else aligned_empty(n, self.dtype)

    def narrow(self, values: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """`values` (float32) in wire form: `values` itself for float32, else written into `out`."""
        if self.exact:
            return values
        _check(out, self.dtype, values.size)
        _tensor(out).copy_(_tensor(values))
        return out

    def widen(self, data: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Wire values `data` written into the float32 array `out`; returns `out`."""
        _check(data, self.dtype, out.size)
        _check(out, protocol.DTYPES["f4"], data.size)
        if self.exact:
            np.copyto(out, data)
        else:
            _tensor(out).copy_(_tensor(data))
        return out

    def finite(self, values: np.ndarray) -> bool:
        """True when float32 `values` arrive finite: flat.all_finite's test, and for a narrow
        dtype no value beyond its range (float16: |x| >= 65520 becomes inf)."""
        if not all_finite(values):
            return False
        if self.tag != "f2" or not values.size:
            return True
        return -_F16_OVERFLOW < values.min() and values.max() < _F16_OVERFLOW


def name_of(data: np.ndarray) -> str:
    """The wire dtype `data`'s items are, by its --wire-dtype name (else numpy's name)."""
    return next((name for name, tag in TAGS.items() if data.dtype == protocol.DTYPES[tag]), str(data.dtype))


def _check(a: np.ndarray, dtype: np.dtype, n: int) -> None:
    if a is None or a.dtype != dtype or a.ndim != 1 or a.size != n or not a.flags.c_contiguous:
        raise ValueError(f"expected a 1-D contiguous {dtype} array of {n} items, got "
                         f"{None if a is None else (a.dtype, a.shape)}")


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A torch view of a wire or float32 array (bfloat16 through its uint16 bits)."""
    if a.dtype == protocol.DTYPES["bf16"]:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
