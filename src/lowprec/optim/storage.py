"""Master-weight strategies: how the FP32 value an optimizer updates is kept between steps.

An update rule sees only FP32 tensors; a strategy names its extra buffers (``buffers``), creates
them (``init``), rebuilds the FP32 master (``load``) and stores a new one (``store``). ``load``
and ``store`` are pure (they return new tensors and write nothing), so the eager step copies
their results into place and the compiled step fuses them with the rule. A new strategy is a
``MasterStorage`` subclass registered in ``STORAGES``; no optimizer changes.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from lowprec.numerics import (
    _pack_16_pairs,
    _pack_rounded_bf16_pairs,
    _unpack_bf16_pairs,
    join,
    round_stochastic_with_bits,
    split,
)

__all__ = ["MASTER_CHOICES", "STORAGES", "MasterStorage", "convert", "resolve_master"]

_HIGH = (torch.float32, torch.float64)


class MasterStorage:
    """Base class of the master-weight strategies (see the module docstring).

    A subclass sets ``name``, implements ``buffers``, ``init``, ``load`` and ``store`` (and
    ``check`` where a dtype is refused), and is registered in ``STORAGES``.
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

    #: Whether the master holds more than the parameter's bits, so that ``init`` can start it
    #: from the FP32 value the parameter was rounded from (``lowprec.optim.kept``).
    takes_value: ClassVar[bool] = False

    def init(self, param: torch.Tensor,
             value: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The buffers of ``buffers(param)``, made from the parameter's current value, or where
        the strategy ``takes_value`` and ``value`` is given, from that FP32 value.

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

    # load/store on pairs of bfloat16 elements ("Pairs" in ``lowprec.numerics``), for the compiled
    # CPU step of the strategies that work on the bits, where int16 would keep it scalar: 16-bit
    # tensors are int32 views holding elements 2j (low half) and 2j+1 (high), 32-bit buffers
    # int64 views. They must give ``load``/``store``'s bits (the fused tests check).

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
    """The parameter is its own master: updates are rounded to nearest in the parameter's dtype
    (exact for FP32; the baseline for BF16/FP16, which loses small updates)."""

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
    """Split SGD: the BF16 parameter is the rounded top half of the FP32 master, the int16 trail
    its low half (``lowprec.numerics.split``: nearest, ties away from zero)."""

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
        if value is None:
            return {"trail": torch.zeros_like(param, dtype=torch.int16)}
        # (split's top differs from the cast's ties-to-even at exact ties: written back)
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
    """Kahan-compensated summation: master = ``param + compensation``, the compensation (in the
    parameter's dtype) holding what rounding to nearest dropped."""

    name = "kahan"

    def buffers(self, param: torch.Tensor) -> dict[str, torch.dtype]:
        return {"compensation": param.dtype}

    takes_value = True

    def init(self, param: torch.Tensor,
             value: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if value is None:
            return {"compensation": torch.zeros_like(param)}
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


class Stochastic(MasterStorage):
    """Stochastic rounding into the parameter's dtype, no buffer; the bits hash (seed, step,
    parameter index, element), so a run is reproducible on every rank and across a resume."""

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
        # The low 16 bits are the even element's noise, the high 16 the odd's (as
        # element_random_bits gives the elementwise store). Each half is _sr_bf16_bits's carry,
        # but a NaN becomes the quiet NaN 0x7FC0: its upper half alone could read as inf.
        return _pack_rounded_bf16_pairs(w_even, w_odd, bits & 0xFFFF, (bits >> 16) & 0xFFFF), {}


#: The master-weight strategies by name (the values of ``master=`` but ``"auto"``).
STORAGES: dict[str, MasterStorage] = {
    s.name: s for s in (NoMaster(), FP32Copy(), Split(), Kahan(), Stochastic())
}

#: Values accepted by the optimizers' ``master=`` argument.
MASTER_CHOICES = ("auto", *STORAGES)


def resolve_master(master: str, dtype: torch.dtype) -> MasterStorage:
    """The storage strategy used for a parameter of ``dtype`` under the ``master=`` option.

    ``"auto"`` is ``"none"`` for FP32/FP64 parameters and ``"kahan"`` for BF16/FP16 ones. Every
    strategy leaves FP32/FP64 parameters plain (their own master), so FP32 layers can share a
    parameter group with BF16 ones; ``"split"`` raises for float16 (its layout is bfloat16's).

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
    storage = STORAGES["kahan" if master == "auto" else master]
    storage.check(dtype)  # (split refuses float16)
    return storage


def convert(
    old: MasterStorage, new: MasterStorage, param: torch.Tensor, bufs: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The FP32 master that ``old`` keeps in ``param`` and ``bufs``, stored ``new``'s way: the new
    parameter value and ``new``'s buffers (pure). Exact into ``"fp32"`` and ``"split"``; into
    ``"stochastic"`` it rounds to nearest (a conversion takes no random bits).
    """
    w = old.load(param, bufs)
    store = STORAGES["none"] if new.needs_random_bits else new
    return store.store(w, param, new.init(param))
