"""Master-weight storage strategies: how the FP32 value an optimizer updates is kept between steps.

An update rule (SGD, AdamW, ...) sees only FP32 tensors: it receives the master value ``w`` and
returns the new one. A storage strategy owns the other half of the contract:

* ``buffers(param)`` names the extra state tensors it keeps for ``param`` and their dtypes;
* ``init(param)`` creates them from the parameter's current value;
* ``load(param, bufs)`` rebuilds the FP32 master value;
* ``store(w, param, bufs, bits)`` turns a new FP32 value into the parameter's new stored value and
  new buffer values.

``load`` and ``store`` are pure tensor functions (they return new tensors and write nothing), so an
eager driver can copy their results into place and a compiled driver can fuse them with the update
rule into one pass. To add a strategy, subclass ``MasterStorage``, implement those four methods and
register it in ``STORAGES``; no optimizer changes.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from lowprec.numerics import (
    _nearest_bf16_upper,
    _pack_16_pairs,
    _pack_nearest_bf16_pairs,
    _pack_rounded_bf16_pairs,
    _unpack_bf16_pairs,
    join,
    round_stochastic_with_bits,
    split,
)

__all__ = ["MASTER_CHOICES", "STORAGES", "MasterStorage", "convert", "resolve_master"]

_HIGH = (torch.float32, torch.float64)
_LOW = (torch.bfloat16, torch.float16)


class MasterStorage:
    """Base class of the master-weight strategies (see the module docstring).

    A subclass sets ``name``, implements ``buffers``, ``init``, ``load`` and ``store`` (and
    ``check`` where a dtype is refused), and is registered in ``STORAGES``; ``load`` and
    ``store`` are pure tensor functions that the eager and the compiled step both run.
    """

    name: ClassVar[str]
    #: Whether ``store`` needs random bits (``bits`` argument).
    needs_random_bits: ClassVar[bool] = False

    def check(self, dtype: torch.dtype) -> None:
        """Raise ``ValueError`` if parameters of ``dtype`` cannot use this strategy.

        Args:
            dtype: The parameter's dtype.
        """

    def buffers(self, param: torch.Tensor) -> dict[str, torch.dtype]:
        """The state tensors this strategy keeps for ``param``, by name, with their dtypes.

        Args:
            param: The parameter.
        """
        return {}

    #: Whether the master holds more than the parameter's own bits (an FP32 copy, a trail, a
    #: compensation), so that ``init`` can start it from the FP32 value the parameter was
    #: rounded from (``lowprec.optim.kept``).
    takes_value: ClassVar[bool] = False

    def init(self, param: torch.Tensor,
             value: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The buffers of ``buffers(param)``, made from the parameter's current value, or where
        the strategy ``takes_value`` and ``value`` is given, from that FP32 value (what
        ``param`` was rounded from), so that the master is ``value`` as nearly as the
        strategy holds it.

        Args:
            param: The parameter.
            value: The FP32 value ``param`` was rounded from (default: None, ``param``'s own).
        """
        return {}

    def load(self, param: torch.Tensor, bufs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The FP32 master value that ``param`` and its buffers hold (pure: writes nothing).

        Args:
            param: The stored parameter.
            bufs: Its buffers, by the names of ``buffers``.
        """
        raise NotImplementedError

    def store(
        self,
        w: torch.Tensor,
        param: torch.Tensor,
        bufs: dict[str, torch.Tensor],
        bits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A new FP32 value ``w`` stored this strategy's way (pure: writes nothing).

        Args:
            w: The new FP32 master value.
            param: The stored parameter before the step.
            bufs: Its buffers before the step.
            bits: 32 random bits per element, for a strategy with ``needs_random_bits``
                (default: None).

        Returns:
            ``(new_param, new_bufs)``.
        """
        raise NotImplementedError

    # The same two operations on pairs of elements (see "Pairs" in ``lowprec.numerics``), for
    # the compiled CPU step of the strategies that work on the bits (split's trail, stochastic
    # rounding's random bits), where int16 tensors would keep it from vectorizing, and of Kahan
    # on a torch whose Inductor drops its round trip elsewhere (``compiled._pairs_pay``; "none"
    # and "fp32" have none: their elementwise kernel is the faster). Only bfloat16 parameters;
    # every 16-bit tensor (param, buffers) is an int32 view holding elements 2j (low half) and
    # 2j+1 (high half), every 32-bit buffer an int64 view. They must give the bits
    # ``load``/``store`` give, element for element; the fused-vs-eager tests check it.

    def pairs_ok(self, dtype: torch.dtype) -> bool:
        """Whether ``load_pairs``/``store_pairs`` exist for parameters of ``dtype``.

        Args:
            dtype: The parameter's dtype.
        """
        return False

    def load_pairs(
        self, param: torch.Tensor, bufs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP32 masters of the even and of the odd elements.

        Args:
            param: The parameter as an int32 view, two 16-bit elements per word.
            bufs: Its buffers, viewed likewise (32-bit buffers as int64).
        """
        raise NotImplementedError

    def store_pairs(
        self,
        w_even: torch.Tensor,
        w_odd: torch.Tensor,
        param: torch.Tensor,
        bufs: dict[str, torch.Tensor],
        bits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """New (param, buffers) words; ``bits`` holds each pair's 32 random bits (even: low half).

        Args:
            w_even: The new FP32 masters of the even elements.
            w_odd: Those of the odd elements.
            param: The parameter as an int32 view, two 16-bit elements per word.
            bufs: Its buffers, viewed likewise.
            bits: Each pair's 32 random bits, for a strategy with ``needs_random_bits``
                (default: None).
        """
        raise NotImplementedError


class NoMaster(MasterStorage):
    """The parameter is its own master: updates are rounded to nearest in the parameter's dtype.

    Exact for FP32 parameters; the naive baseline for BF16/FP16 ones (small updates are lost).
    """

    name = "none"

    def load(self, param: torch.Tensor, bufs: dict[str, torch.Tensor]) -> torch.Tensor:
        return param.float()

    def store(
        self,
        w: torch.Tensor,
        param: torch.Tensor,
        bufs: dict[str, torch.Tensor],
        bits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return w.to(param.dtype), {}


class FP32Copy(MasterStorage):
    """An FP32 copy in optimizer state (classic mixed precision); the parameter is its rounding."""

    name = "fp32"

    def buffers(self, param: torch.Tensor) -> dict[str, torch.dtype]:
        return {"master_weight": torch.float32}

    takes_value = True

    def init(self, param: torch.Tensor,
             value: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"master_weight": (param.detach() if value is None else value).float().clone()}

    def load(self, param: torch.Tensor, bufs: dict[str, torch.Tensor]) -> torch.Tensor:
        return bufs["master_weight"]

    def store(
        self,
        w: torch.Tensor,
        param: torch.Tensor,
        bufs: dict[str, torch.Tensor],
        bits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return w.to(param.dtype), {"master_weight": w}


class Split(MasterStorage):
    """Split SGD: the BF16 parameter is the rounded top half of the FP32 master, the trail its low half.

    See ``lowprec.numerics.split`` for the exact encoding (round to nearest, ties away from zero).
    """

    name = "split"

    def check(self, dtype: torch.dtype) -> None:
        if dtype != torch.bfloat16:
            hint = (
                "use master='fp32' (or 'kahan') for float16 parameters"
                if dtype == torch.float16
                else "use master='none' or 'auto' for them, e.g. in a separate parameter group"
            )
            raise ValueError(
                f"master='split' keeps a BF16 parameter plus a 16-bit trail, so it needs bfloat16 "
                f"parameters, got {dtype}; {hint}."
            )

    def buffers(self, param: torch.Tensor) -> dict[str, torch.dtype]:
        return {"trail": torch.int16}

    takes_value = True

    def init(self, param: torch.Tensor,
             value: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if value is None:  # (the master starts as the parameter's exact value: a zero trail)
            return {"trail": torch.zeros_like(param, dtype=torch.int16)}
        # (the exact FP32 value: its top half is its rounding to nearest, ties away from zero,
        # which differs from a cast's ties to even at exact ties only, written there)
        top, trail = split(value.float())
        param.copy_(top)
        return {"trail": trail}

    def load(self, param: torch.Tensor, bufs: dict[str, torch.Tensor]) -> torch.Tensor:
        return join(param, bufs["trail"])

    def store(
        self,
        w: torch.Tensor,
        param: torch.Tensor,
        bufs: dict[str, torch.Tensor],
        bits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        top, trail = split(w)
        return top, {"trail": trail}

    def pairs_ok(self, dtype: torch.dtype) -> bool:
        return dtype == torch.bfloat16

    def load_pairs(
        self, param: torch.Tensor, bufs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # join() on each half: top * 2**16 + the sign-extended trail, in wrapping int32. The
        # even top moves up (<< 16) and its trail is sign-extended from the low half
        # (<< 16 >> 16); the odd top is already in place and its trail is the arithmetic >> 16.
        p, t = param, bufs["trail"]
        even = ((p << 16) + ((t << 16) >> 16)).view(torch.float32)
        odd = ((p & -65536) + (t >> 16)).view(torch.float32)
        return even, odd

    def store_pairs(
        self,
        w_even: torch.Tensor,
        w_odd: torch.Tensor,
        param: torch.Tensor,
        bufs: dict[str, torch.Tensor],
        bits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        be, bo = w_even.view(torch.int32), w_odd.view(torch.int32)
        # split()'s top, (bits >> 16) + bit 15, is the upper half of bits + 2**15: the low half
        # carries into it exactly when its bit 15 is set. int32 addition wraps (only NaN
        # patterns from 0x7FFF8000 up wrap), which keeps the upper 16 bits right modulo 2**16.
        # Two operations instead of four per element; the even top then moves down.
        re, ro = be + 0x8000, bo + 0x8000
        top = ((re >> 16) & 0xFFFF) | (ro & -65536)
        return top, {"trail": _pack_16_pairs(be, bo)}  # the trails: the low halves


class Kahan(MasterStorage):
    """Kahan-compensated summation: a buffer in the parameter's dtype holds what rounding dropped.

    The master value is ``param + compensation``; after an update the parameter is the new value
    rounded to nearest and the compensation is the remainder, rounded to the parameter's dtype.
    """

    name = "kahan"

    def buffers(self, param: torch.Tensor) -> dict[str, torch.dtype]:
        return {"compensation": param.dtype}

    takes_value = True

    def init(self, param: torch.Tensor,
             value: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if value is None:
            return {"compensation": torch.zeros_like(param)}
        # (the rounding's residual, rounded to the parameter's dtype: what the cast dropped)
        return {"compensation": (value.float() - param.float()).to(param.dtype)}

    def load(self, param: torch.Tensor, bufs: dict[str, torch.Tensor]) -> torch.Tensor:
        return param.float() + bufs["compensation"].float()

    def store(
        self,
        w: torch.Tensor,
        param: torch.Tensor,
        bufs: dict[str, torch.Tensor],
        bits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        new = w.to(param.dtype)
        return new, {"compensation": (w - new.float()).to(param.dtype)}

    def pairs_ok(self, dtype: torch.dtype) -> bool:
        return dtype == torch.bfloat16

    def load_pairs(
        self, param: torch.Tensor, bufs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        (pe, po), (ce, co) = _unpack_bf16_pairs(param), _unpack_bf16_pairs(bufs["compensation"])
        return pe + ce, po + co

    def store_pairs(
        self,
        w_even: torch.Tensor,
        w_odd: torch.Tensor,
        param: torch.Tensor,
        bufs: dict[str, torch.Tensor],
        bits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # store()'s operations on each half: round to nearest, then the remainder rounded.
        be, bo = _nearest_bf16_upper(w_even), _nearest_bf16_upper(w_odd)
        ne, no = be.view(torch.float32), bo.view(torch.float32)
        # _pack_bf16_upper_pairs(be, bo), less its mask of bo's lower half, already zero.
        return ((be >> 16) & 0xFFFF) | bo, {
            "compensation": _pack_nearest_bf16_pairs(w_even - ne, w_odd - no)
        }


class Stochastic(MasterStorage):
    """Stochastic rounding of the new value into the parameter's dtype; no extra buffer.

    The random bits come from a counter-based hash of (seed, step, parameter index, element), so a
    run is reproducible, identical on every rank and resumes bit for bit from a checkpoint.
    """

    name = "stochastic"
    needs_random_bits = True

    def load(self, param: torch.Tensor, bufs: dict[str, torch.Tensor]) -> torch.Tensor:
        return param.float()

    def store(
        self,
        w: torch.Tensor,
        param: torch.Tensor,
        bufs: dict[str, torch.Tensor],
        bits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if bits is None:
            raise ValueError("master='stochastic' needs random bits for its store step.")
        return round_stochastic_with_bits(w, bits, param.dtype), {}

    def pairs_ok(self, dtype: torch.dtype) -> bool:
        return dtype == torch.bfloat16

    def load_pairs(
        self, param: torch.Tensor, bufs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _unpack_bf16_pairs(param)

    def store_pairs(
        self,
        w_even: torch.Tensor,
        w_odd: torch.Tensor,
        param: torch.Tensor,
        bufs: dict[str, torch.Tensor],
        bits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if bits is None:
            raise ValueError("master='stochastic' needs random bits for its store step.")
        # The pair's 32 bits: the low 16 are the even element's noise, the high 16 the odd's,
        # as element_random_bits gives them to the elementwise store. Each half is
        # _sr_bf16_bits's carry of the noise into the kept half, except that a NaN becomes the
        # quiet NaN 0x7FC0 (as in the nearest stores): its own upper half would be inf where
        # its payload lies in the lower half.
        return _pack_rounded_bf16_pairs(w_even, w_odd, bits & 0xFFFF, (bits >> 16) & 0xFFFF), {}


#: The master-weight strategies by name (the values of ``master=`` but ``"auto"``).
STORAGES: dict[str, MasterStorage] = {
    s.name: s for s in (NoMaster(), FP32Copy(), Split(), Kahan(), Stochastic())
}

#: Values accepted by the optimizers' ``master=`` argument.
MASTER_CHOICES = ("auto", *STORAGES)


def resolve_master(master: str, dtype: torch.dtype) -> MasterStorage:
    """The storage strategy used for a parameter of ``dtype`` under the ``master=`` option.

    ``"auto"`` is ``"none"`` for FP32/FP64 parameters and ``"kahan"`` for BF16/FP16 ones. The
    strategies that exist to recover bits a low-precision parameter loses (``"fp32"``, ``"kahan"``,
    ``"stochastic"``) leave FP32/FP64 parameters plain: those are already their own master. This
    lets a model keep some layers in FP32 under one optimizer, in the same parameter groups as
    its BF16 layers (as frameworks build them: Hugging Face Trainer's decay and no-decay groups).
    ``"split"`` does the same for FP32/FP64 parameters and raises for float16, since its memory
    layout (the parameter is the top half of an FP32 value) holds for bfloat16 alone.

    Args:
        master: One of ``MASTER_CHOICES``.
        dtype: The parameter's dtype.

    Returns:
        The strategy, one of ``STORAGES``' values.

    Raises:
        ValueError: An unknown ``master``, or ``"split"`` for a float16 parameter.

    Examples:
        >>> import torch
        >>> from lowprec.optim import resolve_master
        >>> resolve_master("auto", torch.bfloat16).name, resolve_master("auto", torch.float32).name
        ('kahan', 'none')
    """
    if master not in MASTER_CHOICES:
        raise ValueError(f"unknown master={master!r}; choose one of {', '.join(MASTER_CHOICES)}.")
    if dtype in _HIGH:
        return STORAGES["none"]
    if master == "split":
        STORAGES["split"].check(dtype)
        return STORAGES["split"]
    if master == "auto":
        return STORAGES["kahan"]
    return STORAGES[master]


def convert(
    old: MasterStorage, new: MasterStorage, param: torch.Tensor, bufs: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The FP32 master that ``old`` keeps in ``param`` and ``bufs``, stored ``new``'s way: the new
    parameter value and ``new``'s buffers (pure, as ``load``/``store``).

    Exact where ``new`` holds an FP32 value (``"fp32"``, ``"split"``); ``"kahan"`` keeps it to
    its compensation's precision (the parameter's significant bits twice); ``"none"`` and
    ``"stochastic"`` round it to the parameter's dtype, to nearest (one rounding, so the
    conversion itself needs no random bits).
    """
    w = old.load(param, bufs)
    store = STORAGES["none"] if new.needs_random_bits else new
    return store.store(w, param, new.init(param))
