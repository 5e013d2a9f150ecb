"""Named ways to train: a recipe converts a model, builds its optimizer and runs its steps.

A recipe is small and explicit, in the manner of Lightning's precision plugins:

    recipe = lowprec.recipes.get("bf16-kahan")
    model = recipe.convert(model)                   # BF16 weights, norm layers kept in FP32
    optimizer = recipe.optimizer("adamw", model.parameters(), lr=1e-3)
    for x, y in data:
        optimizer.zero_grad()
        with recipe.autocast():                     # torch.autocast on the model's device
            loss = loss_fn(model(x), y)             # outputs come back in FP32
        recipe.backward(loss)                       # scaled backward where the recipe scales
        if recipe.step(optimizer):                  # False when a step was skipped
            scheduler.step()

The recipes (``RECIPES``):

| name | weights | optimizer master | autocast | loss scaling |
|---|---|---|---|---|
| ``fp32`` | FP32 | none | no | no |
| ``amp-bf16`` | FP32 | none | BF16 | no (BF16 has FP32's range) |
| ``amp-fp16`` | FP32 | none | FP16 | dynamic |
| ``bf16`` | BF16 | none | no | no |
| ``bf16-kahan`` | BF16 | kahan | no | no |
| ``bf16-split`` | BF16 | split | no | no |
| ``bf16-sr`` | BF16 | stochastic | no | no |
| ``bf16-kahan-8bit`` | BF16 | kahan, 8-bit state | no | no |
| ``bf16-split-8bit`` | BF16 | split, 8-bit state | no | no |
| ``bf16-kahan-8bit-release`` | BF16 | kahan, 8-bit state, stepped in backward | no | no |
| ``bf16-kahan-4bit`` | BF16 | kahan, 4-bit state | no | no |
| ``bf16-kahan-4bit-release`` | BF16 | kahan, 4-bit state, stepped in backward | no | no |
| ``fp16-master`` | FP16 | fp32 | no | dynamic (Micikevicius et al.) |
| ``dfp16`` | FP32 (master) | none | no | no (shared exponents, Das et al.) |
| ``mxfp8``, ``mxfp8-split`` | BF16 | kahan / split | no | no (Linear GEMMs in MXFP8) |
| ``mxfp8-8bit`` | BF16 | kahan, 8-bit state | no | no (Linear GEMMs in MXFP8) |
| ``mxfp8-bf16`` | BF16 | none | no | no (Linear GEMMs in MXFP8) |
| ``mxfp6``, ``mxfp4`` | BF16 | kahan | no | no (Linear GEMMs in MXFP6 E2M3 / MXFP4) |
| ``nvfp4`` | BF16 | kahan | no | no (NVIDIA's NVFP4 recipe) |
| ``nvfp4-bf16`` | BF16 | none | no | no (NVIDIA's NVFP4 recipe) |
| ``nvfp4-bare``, ``nvfp4-no-*`` | BF16 | kahan | no | no (NVFP4 without its extras) |

Converting a model to a low-precision dtype keeps chosen layer types in FP32 (by default the
normalization layers, whose statistics are fragile in 8 or 11 bits): their inputs are cast to
FP32 on the way in and their outputs back on the way out. The converted model casts floating
inputs to its dtype and returns FP32 outputs, so softmax and the loss are computed in FP32.

``dfp16`` (Das et al. 2018) keeps FP32 weights, which are the master copy, and swaps every
``nn.Linear`` and ``nn.Conv2d`` for its DFP-16 version (``lowprec.dfp.convert_to_dfp``): their
products are INT16 x INT16 summed in INT32, with activations, weights and output gradients
quantized to INT16 mantissas sharing one exponent. Everything else (embeddings, attention,
normalization, the loss) stays FP32, as in the paper. The exponent has FP32's whole range, so no
loss scaling is needed. DFP is exact integer emulation and slow: see docs/dfp.md.

The block-format recipes (``mxfp8`` ... ``nvfp4-*``, ``lowprec.blockfmt``) swap every ``nn.Linear``
outside the kept layers for a ``BlockLinear``: its forward and both backward GEMMs quantize
their operands to the format along each GEMM's reduction dimension and multiply in FP32, as the
hardware does; the weights stay BF16 under the recipe's master, and everything else runs as in
``bf16-kahan``. Each follows a published recipe: ``mxfp8`` torchao's MXFP8 training (E4M3, all
three GEMMs, the ``rceil`` scale rule), ``mxfp6``/``mxfp4`` the OCP rule of Rouhani et al.
(2023), and ``nvfp4`` NVIDIA's NVFP4 pretraining (arXiv 2509.25149): 16 x 16 weight tiles,
stochastic rounding of gradients, a random Hadamard transform on the weight-gradient GEMM's
inputs, and the first and last Linear layers kept in BF16. ``nvfp4-bare`` has none of those
extras and each ``nvfp4-no-*`` lacks one (``-no-2d``, ``-no-sr``, ``-no-rht``, ``-no-edges``),
so a table shows what each buys. See docs/block-formats.md.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from lowprec import optim
from lowprec.blockfmt import BlockGemms, convert_to_blocks, edge_linears
from lowprec.dfp import ROUNDING_MODES, Rounding, convert_to_dfp
from lowprec.optim.kept import note as keep_fp32_value

# (The products' names, where they lived before lowprec.products, stay importable from here.)
from lowprec.products import BF16_PRODUCTS_ENV as BF16_PRODUCTS_ENV
from lowprec.products import HalfProductsInFP32 as HalfProductsInFP32
from lowprec.products import LowPrecisionProductsInFP32 as LowPrecisionProductsInFP32
from lowprec.products import bf16_products_in_fp32 as bf16_products_in_fp32
from lowprec.products import cast_floats
from lowprec.products import cpu_has_fast_bf16_matmul as cpu_has_fast_bf16_matmul
from lowprec.scaling import LossScaler

if TYPE_CHECKING:  # pragma: no cover
    from torch.optim.optimizer import ParamsT

__all__ = [
    "NORM_LAYERS",
    "RECIPES",
    "Recipe",
    "get",
    "names",
]

#: Layer types kept in FP32 by default.
NORM_LAYERS: tuple[type[nn.Module], ...] = tuple(
    t for t in (
        nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
        nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, getattr(nn, "RMSNorm", None),
    ) if t is not None
)

_OPTIMIZERS: dict[str, Callable[..., optim.LowPrecisionOptimizer]] = {
    "sgd": optim.SGD, "adagrad": optim.Adagrad, "lamb": optim.Lamb, "adamw": optim.AdamW,
    "adam": optim.Adam, "radam": optim.RAdam, "lion": optim.Lion,
    "stableadamw": optim.StableAdamW, "adafactor": optim.Adafactor, "muon": optim.Muon,
}


@dataclass
class Recipe:
    """One way to train: weight dtype, master strategy, autocast and loss scaling.

    Create recipes with ``lowprec.recipes.get(name)``; each holds its own ``LossScaler`` (when it
    scales), so use one recipe object per training run.

    Attributes:
        name: The recipe's name.
        param_dtype: dtype of the converted model's weights.
        master: The lowprec optimizer's ``master`` strategy.
        autocast_dtype: dtype for ``torch.autocast``, or None (default: None).
        loss_scaling: ``"dynamic"``, ``"static"`` or None (default: None).
        keep_fp32: Layers left in FP32 by ``convert``: module types, and module names (as in
            ``named_modules()``: ``"lm_head"``, or a trailing part of the name that matches
            every layer so named, ``"q_norm"``: where ``lowprec.compare`` finds parameters no
            master keeps) (default: ``NORM_LAYERS``).
        scaler_options: Options passed to ``LossScaler`` (default: none).
        dfp_rounding: When set, ``convert`` swaps Linear/Conv2d layers for DFP-16 ones with this
            rounding (``"nearest"``, ``"stochastic"``, ``"biased"`` or ``"floor"``) for
            activations, weights and output gradients (default: None, no DFP).
        state_dtype: The optimizer's ``state_dtype`` (default: None, the strategy's own;
            ``"8bit"``/``"4bit"`` for 8-bit/4-bit moments).
        step_in_backward: Step each parameter during backward and free its gradient at once
            (``lowprec.step_in_backward``; ``optimizer`` then needs the model) (default: False).
        gemms: When set, ``convert`` swaps ``nn.Linear`` layers for ``lowprec.blockfmt``'s
            ``BlockLinear`` with these GEMMs (default: None, no block formats).
        gemms_skip_edges: Leave the model's first and last ``nn.Linear`` in the weights'
            dtype, as NVIDIA's NVFP4 recipe keeps them in BF16 (default: False).
        description: One line for tables (default: empty).
    """

    name: str
    param_dtype: torch.dtype
    master: str
    state_dtype: torch.dtype | str | None = None
    autocast_dtype: torch.dtype | None = None
    loss_scaling: str | None = None
    keep_fp32: tuple[type[nn.Module] | str, ...] = NORM_LAYERS
    scaler_options: dict[str, Any] = field(default_factory=dict)
    dfp_rounding: Rounding | None = None
    step_in_backward: bool = False
    gemms: BlockGemms | None = None
    gemms_skip_edges: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        bad = [k for k in self.keep_fp32
               if not (isinstance(k, str) or (isinstance(k, type) and issubclass(k, nn.Module)))]
        if bad:
            raise TypeError(f"recipe {self.name!r}: keep_fp32 takes module types and module "
                            f"names, got {bad[0]!r}.")
        if self.dfp_rounding is not None and self.dfp_rounding not in ROUNDING_MODES:
            raise ValueError(
                f"dfp_rounding must be one of {', '.join(map(repr, ROUNDING_MODES))} or None, "
                f"got {self.dfp_rounding!r}."
            )
        if self.dfp_rounding is not None and self.param_dtype != torch.float32:
            raise ValueError(
                f"recipe {self.name!r}: DFP layers keep FP32 master weights; set "
                "param_dtype=torch.float32."
            )
        if self.step_in_backward and self.loss_scaling is not None:
            raise ValueError(
                f"recipe {self.name!r}: step_in_backward cannot skip a step on inf/NaN (each "
                "parameter is stepped during backward), so it cannot have loss_scaling; use "
                "BF16 weights, which need none."
            )
        self.scaler: LossScaler | None = None
        if self.loss_scaling is not None:
            if self.loss_scaling not in ("dynamic", "static"):
                raise ValueError(
                    f"loss_scaling must be 'dynamic', 'static' or None, got {self.loss_scaling!r}."
                )
            self.scaler = LossScaler(
                dynamic=self.loss_scaling == "dynamic", **self.scaler_options
            )
        # The model ``convert`` returned, whose device ``autocast()`` follows (weakly held: the
        # recipe does not keep a model alive).
        self._converted: weakref.ref[nn.Module] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_converted": None}  # (a weak reference does not pickle)

    # ------------------------------------------------------------------ the model

    def _kept_layers(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The layers of ``model`` that ``keep_fp32`` names, by type or by name (a name matches
        the layer of that name, and every layer whose name ends with ``"." + name``)."""
        types = tuple(k for k in self.keep_fp32 if isinstance(k, type))
        names = [k for k in self.keep_fp32 if isinstance(k, str)]
        return [(n, m) for n, m in model.named_modules()
                if (types and isinstance(m, types))
                or any(n == k or n.endswith("." + k) for k in names)]

    def convert(self, model: nn.Module, *, fp32_values: bool = True) -> nn.Module:
        """Cast ``model`` in place to the recipe's weight dtype and return it.

        Parameters and floating buffers of ``keep_fp32`` layers stay FP32, with hooks casting
        their inputs to FP32 and outputs back. The model casts floating inputs to its dtype and
        returns FP32 floating outputs. A DFP recipe swaps ``nn.Linear``/``nn.Conv2d`` layers for
        DFP-16 ones (sharing their parameters), except those inside ``keep_fp32`` layers, and a
        block-format recipe swaps ``nn.Linear`` layers for ``BlockLinear`` ones likewise; when
        ``model`` is itself such a layer the new module is returned, so use the return value.
        Calling ``convert`` twice is an error.

        The FP32 values of the trainable parameters cast to a 16-bit dtype are kept for the
        recipe's optimizer (``lowprec.keep_fp32_values``): its master then starts from them
        (the split master exact, Kahan's compensation as the rounding residual, the FP32 copy as
        the value) and lets them go at its first step; plain BF16 and stochastic rounding start
        from the rounded weights and keep nothing.

        Args:
            model: The model to convert, in place.
            fp32_values: Keep the FP32 values for the optimizer's master (default: True;
                False: the master starts from the rounded weights, as the cast leaves them).

        Returns:
            The converted model (a new module only where ``model`` itself is replaced).

        Raises:
            TypeError: Not an ``nn.Module``.
            ValueError: The model was already converted.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"convert() takes an nn.Module, got {type(model).__name__}.")
        if getattr(model, "_lowprec_recipe", None) is not None:
            raise ValueError(
                f"this model was already converted by recipe {model._lowprec_recipe!r}; "
                "convert a fresh copy of the model instead."
            )
        dtype = self.param_dtype
        if self.dfp_rounding is not None:
            kept = [n for n, _ in self._kept_layers(model)]
            model = convert_to_dfp(model, rounding=self.dfp_rounding, skip=kept)
        if self.gemms is not None:
            kept = [n for n, _ in self._kept_layers(model)]
            if self.gemms_skip_edges:
                kept += edge_linears(model)
            model = convert_to_blocks(model, self.gemms, skip=kept)
        if dtype == torch.float32:
            # (setattr: an attribute nn.Module's annotations do not allow, a str)
            setattr(model, "_lowprec_recipe", self.name)  # noqa: B010
            self._converted = weakref.ref(model)
            return model
        kept = [m for _, m in self._kept_layers(model)]
        kept_ids = {id(t) for m in kept for t in (*m.parameters(), *m.buffers())}
        for module in model.modules():
            for p in list(module.parameters(recurse=False)):
                if id(p) not in kept_ids and p.is_floating_point():
                    value = p.data
                    p.data = value.to(dtype)
                    if fp32_values and p.requires_grad and value.dtype == torch.float32:
                        keep_fp32_value(p, value)
            for name, b in list(module.named_buffers(recurse=False)):
                if id(b) not in kept_ids and b.is_floating_point():
                    module._buffers[name] = b.to(dtype)
        for m in kept:
            m.register_forward_pre_hook(lambda _m, args: cast_floats(args, torch.float32))
            m.register_forward_hook(lambda _m, _a, out: cast_floats(out, dtype))
        model.register_forward_pre_hook(lambda _m, args: cast_floats(args, dtype))
        model.register_forward_hook(lambda _m, _a, out: cast_floats(out, torch.float32))
        setattr(model, "_lowprec_recipe", self.name)  # noqa: B010
        self._converted = weakref.ref(model)
        return model

    # ------------------------------------------------------------------ the optimizer

    def optimizer(
        self, name: str, params: ParamsT | nn.Module, **hyperparameters: Any
    ) -> optim.LowPrecisionOptimizer:
        """A lowprec optimizer by name (``"sgd"``, ``"adagrad"``, ``"lamb"``, ``"adamw"``,
        ``"adam"``, ``"radam"``, ``"lion"``, ``"stableadamw"``, ``"adafactor"``, ``"muon"``)
        with this recipe's master strategy; FP32 parameters (e.g. kept norm layers) are updated
        plainly.

        ``params`` may be the model itself: its parameters, and for ``"muon"`` its two groups
        (``optim.muon_param_groups``: Muon for the hidden layers' matrices, AdamW for the rest,
        whose options are the keyword ``adamw``, a dict).

        Args:
            name: The optimizer's name (case does not matter).
            params: The parameters or parameter groups, or the model (which a ``-release``
                recipe needs, to install ``step_in_backward``).
            **hyperparameters: The optimizer's options (``lr``, ``weight_decay``, ...; for
                ``"muon"`` also ``adamw``); the recipe sets ``master`` and ``state_dtype``.

        Returns:
            The optimizer.

        Raises:
            ValueError: An unknown optimizer name, ``master`` or ``state_dtype`` that the
                recipe sets, or parameters where the model is needed (``adamw=``, a
                ``-release`` recipe).
        """
        key = name.lower() if isinstance(name, str) else name
        if key not in _OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {name!r}; choose one of {', '.join(_OPTIMIZERS)}."
            )
        for option in ("master", "state_dtype"):
            if option in hyperparameters and getattr(self, option) is not None:
                raise ValueError(
                    f"recipe {self.name!r} sets {option}={getattr(self, option)!r}; build the "
                    "optimizer directly from lowprec.optim to choose another."
                )
        if self.state_dtype is not None:
            hyperparameters = {**hyperparameters, "state_dtype": self.state_dtype}
        adamw = hyperparameters.pop("adamw", None)
        model = params if isinstance(params, nn.Module) else None
        if model is not None:
            params = (optim.muon_param_groups(model, adamw=adamw) if key == "muon"
                      else model.parameters())
        elif adamw is not None:
            raise ValueError("adamw= (the options of Muon's AdamW group) needs the model as "
                             "params, whose groups it then makes.")
        elif self.step_in_backward:
            raise ValueError(f"recipe {self.name!r} steps inside backward, whose hooks it "
                             "installs on the model: pass the model as params.")
        opt = _OPTIMIZERS[key](params, master=self.master, **hyperparameters)
        if self.step_in_backward:  # (the handle lives on the optimizer: core.Stages.in_backward)
            optim.step_in_backward(cast(nn.Module, model), opt)  # (None raised above)
        return opt

    # ------------------------------------------------------------------ the step

    def autocast(self, device: str | torch.device | None = None
                 ) -> contextlib.AbstractContextManager[Any]:
        """The forward context: ``torch.autocast`` for the amp-* recipes, or a
        ``LowPrecisionProductsInFP32`` mode where the CPU lacks the recipe's 16-bit arithmetic,
        else a no-op.

        On the CPU, FP16 weights get ``HalfProductsInFP32`` (FP16 products summed in FP32, as
        FP16 hardware does); where ``bf16_products_in_fp32()`` (this CPU has no fast BF16 matmul,
        unless ``LOWPREC_BF16_PRODUCTS`` says otherwise), BF16 weights get
        ``LowPrecisionProductsInFP32(torch.bfloat16)`` and ``amp-bf16`` gets
        ``LowPrecisionProductsInFP32(torch.bfloat16, autocast=True)``, which is
        ``torch.autocast`` with its BF16 products computed that way. A GPU has the hardware and
        gets torch's own kernels. BF16 weights need no device: without one the mode is entered,
        and it changes only products on CPU tensors.

        Args:
            device: Where the forward runs: a device type (``"cuda"``, ``"cpu"``), a device
                (``"cuda:1"``, a ``torch.device``), or None for the device of the model that
                ``convert`` returned, read at this call (so a model moved after ``convert``
                is followed) (default: None).

        Raises:
            ValueError: ``device`` is None where the recipe needs a device (autocast, FP16
                weights) and it has converted no model, or that model has no tensors.
        """
        if self.autocast_dtype is None and self.param_dtype == torch.bfloat16:
            if not bf16_products_in_fp32():
                return contextlib.nullcontext()
            # (The mode acts on CPU tensors only, so BF16 weights need no device: without one it
            # is entered, and computes nothing differently on a GPU.)
            device_type = (self._model_device_type() if device is None
                           else torch.device(device).type)
            return (LowPrecisionProductsInFP32(torch.bfloat16) if device_type in (None, "cpu")
                    else contextlib.nullcontext())
        if self.autocast_dtype is None and self.param_dtype != torch.float16:
            return contextlib.nullcontext()
        device_type = self._device_type() if device is None else torch.device(device).type
        if self.autocast_dtype is None:  # FP16 weights
            return HalfProductsInFP32() if device_type == "cpu" else contextlib.nullcontext()
        if (self.autocast_dtype == torch.bfloat16 and device_type == "cpu"
                and bf16_products_in_fp32()):
            return LowPrecisionProductsInFP32(torch.bfloat16, autocast=True)
        return torch.autocast(device_type, dtype=self.autocast_dtype)

    def _model_device_type(self) -> str | None:
        """The device type of the model ``convert`` returned (its first tensor's), or None."""
        model = self._converted() if self._converted is not None else None
        first = None
        if model is not None:
            first = next(itertools.chain(model.parameters(), model.buffers()), None)
        return None if first is None else first.device.type

    def _device_type(self) -> str:
        """The device type of the model ``convert`` returned; a ``ValueError`` without one."""
        device_type = self._model_device_type()
        if device_type is None:
            raise ValueError(
                f"recipe {self.name!r}: autocast() needs the device the forward runs on; "
                "convert the model with this recipe first (recipe.convert(model)), or name the "
                "device: recipe.autocast('cuda')."
            )
        return device_type

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled where the recipe scales.

        Args:
            loss: The loss (a scalar tensor).
        """
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step (skipping on inf/NaN where the recipe scales) and update the scale.

        Args:
            optimizer: The optimizer the recipe built.

        Returns:
            Whether the optimizer stepped.
        """
        if self.scaler is None:
            optimizer.step()
            return True
        stepped = self.scaler.step(optimizer)
        self.scaler.update()
        return bool(stepped)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale gradients in place before clipping (a no-op without loss scaling).

        Args:
            optimizer: The optimizer whose gradients to unscale.
        """
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The recipe's name and its loss scaler's state (None without one), for checkpoints."""
        return {"name": self.name, "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loss scaler's state from ``state_dict()``.

        Args:
            state: What ``state_dict()`` returned.

        Raises:
            ValueError: The checkpoint is of another recipe.
        """
        if state.get("name") != self.name:
            raise ValueError(
                f"this checkpoint is for recipe {state.get('name')!r}, not {self.name!r}."
            )
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def _block_specs() -> dict[str, dict[str, Any]]:
    """The block-format recipes: BF16 weights, Linear GEMMs in a block format."""
    mxfp8 = BlockGemms("mxfp8", scale_rule="rceil")  # torchao's MXFP8 training
    # NVIDIA's NVFP4 pretraining: 2D weight tiles, stochastic rounding of gradients, a random
    # Hadamard transform on the weight gradient's inputs, the first and last layers in BF16.
    nv = BlockGemms("nvfp4", weight_tiles=True, grad_rounding="stochastic", hadamard=True)
    what = "Linear GEMMs in"

    def spec(master: str, gemms: BlockGemms, description: str, **more: Any) -> dict[str, Any]:
        return dict(param_dtype=torch.bfloat16, master=master, gemms=gemms,
                    description=description, **more)

    return {
        "mxfp8": spec("kahan", mxfp8, f"BF16 + Kahan, {what} MXFP8 E4M3 (torchao's recipe)."),
        "mxfp8-split": spec("split", mxfp8, f"BF16 + 16-bit trail, {what} MXFP8 E4M3."),
        "mxfp8-8bit": spec("kahan", mxfp8, f"BF16 + Kahan, 8-bit moments, {what} MXFP8 E4M3.",
                           state_dtype="8bit"),
        "mxfp8-bf16": spec("none", mxfp8, f"Plain BF16 weights, {what} MXFP8 E4M3."),
        "mxfp6": spec("kahan", BlockGemms("mxfp6"),
                      f"BF16 + Kahan, {what} MXFP6 E2M3 (OCP scale rule)."),
        "mxfp4": spec("kahan", BlockGemms("mxfp4"),
                      f"BF16 + Kahan, {what} MXFP4 (OCP scale rule)."),
        "nvfp4": spec("kahan", nv, f"BF16 + Kahan, {what} NVFP4, NVIDIA's recipe.",
                      gemms_skip_edges=True),
        "nvfp4-bf16": spec("none", nv, f"Plain BF16 weights, {what} NVFP4, NVIDIA's recipe.",
                           gemms_skip_edges=True),
        "nvfp4-bare": spec("kahan", BlockGemms("nvfp4"),
                           f"BF16 + Kahan, {what} NVFP4 with none of the extras."),
        "nvfp4-no-2d": spec("kahan", replace(nv, weight_tiles=False),
                            "nvfp4 with 1D weight blocks.", gemms_skip_edges=True),
        "nvfp4-no-sr": spec("kahan", replace(nv, grad_rounding="nearest"),
                            "nvfp4 with gradients rounded to nearest.", gemms_skip_edges=True),
        "nvfp4-no-rht": spec("kahan", replace(nv, hadamard=False),
                             "nvfp4 without the Hadamard transform.", gemms_skip_edges=True),
        "nvfp4-no-edges": spec("kahan", nv, "nvfp4 with the first and last Linear layers in "
                               "NVFP4 too."),
    }


_SPECS: dict[str, dict[str, Any]] = {
    "fp32": dict(param_dtype=torch.float32, master="none",
                 description="FP32 weights and math: the reference."),
    "amp-bf16": dict(param_dtype=torch.float32, master="none", autocast_dtype=torch.bfloat16,
                     description="FP32 weights, torch.autocast to BF16."),
    "amp-fp16": dict(param_dtype=torch.float32, master="none", autocast_dtype=torch.float16,
                     loss_scaling="dynamic",
                     description="FP32 weights, torch.autocast to FP16, dynamic loss scaling."),
    "bf16": dict(param_dtype=torch.bfloat16, master="none",
                 description="Pure BF16 weights and state, rounded to nearest."),
    "bf16-kahan": dict(param_dtype=torch.bfloat16, master="kahan",
                       description="BF16 weights with a BF16 Kahan compensation buffer."),
    "bf16-split": dict(param_dtype=torch.bfloat16, master="split",
                       description="BF16 weights with a 16-bit trail: an exact FP32 master."),
    "bf16-sr": dict(param_dtype=torch.bfloat16, master="stochastic",
                    description="BF16 weights with stochastic rounding."),
    "bf16-kahan-8bit": dict(param_dtype=torch.bfloat16, master="kahan", state_dtype="8bit",
                            description="BF16 weights, Kahan compensation, 8-bit moments."),
    "bf16-split-8bit": dict(param_dtype=torch.bfloat16, master="split", state_dtype="8bit",
                            description="BF16 weights with a 16-bit trail, 8-bit moments."),
    "bf16-kahan-8bit-release": dict(
        param_dtype=torch.bfloat16, master="kahan", state_dtype="8bit", step_in_backward=True,
        description="BF16 + Kahan + 8-bit moments, each stepped in backward, gradient freed."),
    "bf16-kahan-4bit": dict(param_dtype=torch.bfloat16, master="kahan", state_dtype="4bit",
                            description="BF16 weights, Kahan compensation, 4-bit moments."),
    "bf16-kahan-4bit-release": dict(
        param_dtype=torch.bfloat16, master="kahan", state_dtype="4bit", step_in_backward=True,
        description="BF16 + Kahan + 4-bit moments, each stepped in backward, gradient freed."),
    "fp16-master": dict(param_dtype=torch.float16, master="fp32", loss_scaling="dynamic",
                        description="FP16 weights, FP32 master copy, dynamic loss scaling."),
    "dfp16": dict(param_dtype=torch.float32, master="none", dfp_rounding="nearest",
                  description="FP32 master weights, Linear/Conv2d in DFP-16 with INT32 sums."),
    **_block_specs(),
}

#: The recipe names, in display order.
RECIPES: tuple[str, ...] = tuple(_SPECS)


def names() -> tuple[str, ...]:
    """The valid recipe names."""
    return RECIPES


def get(name: str, **overrides: Any) -> Recipe:
    """A new ``Recipe`` by name; ``overrides`` replace its fields (e.g. ``keep_fp32=()``).

    Args:
        name: One of ``RECIPES``.
        **overrides: New values of the fields ``keep_fp32``, ``scaler_options``,
            ``loss_scaling`` and ``dfp_rounding`` (the last for DFP recipes only).

    Returns:
        A new recipe (each holds its own loss scaler: use one per training run).

    Raises:
        ValueError: An unknown name, or a ``dfp_rounding`` that does not apply.
        TypeError: An unknown override.

    Examples:
        >>> import torch
        >>> import lowprec
        >>> recipe = lowprec.recipes.get("bf16-kahan")
        >>> model = recipe.convert(torch.nn.Sequential(torch.nn.Linear(8, 8),
        ...                                            torch.nn.LayerNorm(8)))
        >>> model[0].weight.dtype, model[1].weight.dtype  # norm layers kept in FP32
        (torch.bfloat16, torch.float32)
        >>> opt = recipe.optimizer("adamw", model.parameters(), lr=1e-3)
        >>> opt.param_groups[0]["master"]
        'kahan'
    """
    if name not in _SPECS:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}.")
    valid = ("keep_fp32", "scaler_options", "loss_scaling", "dfp_rounding")
    unknown = set(overrides) - set(valid)
    if unknown:
        raise TypeError(f"get() got unknown options {sorted(unknown)}; valid: {', '.join(valid)}.")
    if "dfp_rounding" in overrides:
        if _SPECS[name].get("dfp_rounding") is None:
            raise ValueError(
                f"dfp_rounding applies to DFP recipes only; recipe {name!r} has no DFP layers "
                "(use 'dfp16')."
            )
        if overrides["dfp_rounding"] is None:
            raise ValueError(
                f"recipe {name!r} needs a dfp_rounding; for no DFP layers use recipe 'fp32'."
            )
    return Recipe(name=name, **{**_SPECS[name], **overrides})
