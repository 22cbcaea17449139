"""`ampnb.diagnosis.replay(path)`: rerun the step a watch kept on its first overflow, with the hunter.

The file is loaded as data only (`weights_only=True`), and `model=` is checked before it is read.
What it redoes: the model as it was before that step (its state loaded into the fresh `model=`
given, or, with `trust_pickled_model=True` only, the model pickled in the file), the RNG states
at the step's first forward, and each micro-batch in order — its forward under the autocast that
was on, then the user's own backward: the gradient their
loss sent into the model's outputs, loss scale included, as the watch kept it — until the
hunter finds the first non-finite op. The loss function itself is not saved: an overflow inside
the user's loss shows as a non-finite output gradient, not as an op. A step kept by an older
watch (no output gradients) or an output that got none falls back to the model's own loss,
`loss_fn(output)`, or the sum of the floating outputs.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from functools import cached_property
from typing import Any

import torch
from torch import nn

from ampnb.batch import Batch, model_loss
from ampnb.display import Table, TableView
from ampnb.putback import Rng, rng_kept


def _check_arguments(path: Any, model: Any, trust_pickled_model: Any) -> None:
    """The arguments, checked before the file is read."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path={path!r} is not allowed; allowed: the file or folder that "
                         "ampnb.watch(..., keep_overflow=...) wrote")
    if model is not None and not isinstance(model, nn.Module):
        raise ValueError(f"model={type(model).__name__} is not allowed; allowed: None or a "
                         "fresh instance of the watched model's class")
    if not isinstance(trust_pickled_model, bool):
        raise ValueError(f"trust_pickled_model={trust_pickled_model!r} is not allowed; allowed: "
                         "True or False")
    if model is None and not trust_pickled_model:
        raise ValueError("replay needs model=, a fresh instance of the watched model's class "
                         "(the kept state is loaded into it); allowed too: "
                         "trust_pickled_model=True, which unpickles the model the file holds "
                         "and so runs code from it: only for a file you trust")


def _load(path: str | os.PathLike) -> dict[str, Any]:
    """The kept step: data only (weights_only=True), whoever wrote the file."""
    from ampnb.watcher.overflow import FORMAT, target, unpickling_error

    file = target(path)
    if not file.is_file():
        raise ValueError(f"path={str(path)!r} holds no saved step ({file} is missing); allowed: "
                         "what ampnb.watch(..., keep_overflow=...) wrote on a skipped step")
    try:
        data = torch.load(file, weights_only=True)
    except Exception as e:  # noqa: BLE001 - UnpicklingError, a damaged archive: refused alike
        raise ValueError(f"{file} is not data only, so it was not loaded (torch.load with "
                         f"weights_only=True: {unpickling_error(e)}); allowed: a file "
                         "ampnb.watch(..., keep_overflow=...) wrote; trust_pickled_model=True "
                         "trusts only the model inside such a file") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{file} is not a step saved by this version of ampnb.watch")
    return data


def _model(data: dict[str, Any], model: nn.Module | None, trust: bool) -> nn.Module:
    from ampnb.watcher.hooks import strip_gone

    if model is not None:
        try:
            model.load_state_dict(data["state_dict"])
        except RuntimeError as e:  # torch's several lines: missing and unexpected keys, shapes
            why = " ".join(str(e).split())[:200]
            raise ValueError(f"model={type(model).__name__} does not take the kept state "
                             f"({why}); allowed: a fresh instance of {data['model_class']}"
                             ) from None
    elif not isinstance(data["model"], bytes):
        raise ValueError(f"the watched {data['model_class']} could not be pickled; pass "
                         "model=, a fresh instance of it (its saved state is loaded into it)")
    else:  # trust_pickled_model=True: the caller trusts the file, and only then is it unpickled
        model = torch.load(io.BytesIO(data["model"]), weights_only=False)
        if not isinstance(model, nn.Module):
            raise ValueError(f"the pickled model is {type(model).__name__}, not an nn.Module; "
                             "pass model=, a fresh instance of the watched model's class")
        strip_gone(model)
    return model.train(data["training"])


def _loss(out: Any, loss_fn: Callable[[Any], Any] | None) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(out)
    own = model_loss(out)
    if own is not None:
        return own
    from ampnb.watcher.hooks import float_outputs

    return sum(t.float().sum() for t in float_outputs(out))


class Replay(TableView):
    """The kept step rerun: `.nonfinite` (the hunter's finding), `.report` (the doctor's)."""

    def __init__(self, path: str | os.PathLike, data: dict[str, Any], model: nn.Module,
                 loss_fn: Callable[[Any], Any] | None) -> None:
        self.path, self.step, self.model = path, data["step"], model
        self.scale: float | None = data["scale"]
        self.autocast = tuple((d, getattr(torch, dt)) for d, dt in data["autocast"])
        self.batches = tuple(Batch(tuple(a), dict(k)) for a, k in data["inputs"])
        grads = data.get("out_grads") or []
        self.out_grads = tuple(list(grads[k]) if k < len(grads) else []
                               for k in range(len(self.batches)))
        # the module each forward entered: the model, or a child its loop called directly
        self.entries = tuple(model.get_submodule(e) for e in data["entries"])
        self.loss_fn = loss_fn
        self.micro_batch, self.nonfinite = self._hunt(data["rng"])

    def _forward(self, entry: nn.Module, batch: Batch) -> Any:
        from ampnb.watcher.overflow import autocast_as

        with autocast_as(self.autocast):  # the autocast the step's forward ran under
            return batch.call(entry)

    def _step(self, entry: nn.Module, batch: Batch, grads: list) -> None:
        from ampnb.precision import Precision
        from ampnb.watcher.hooks import float_outputs

        out = self._forward(entry, batch)
        outs = float_outputs(out)
        if grads and any(g is not None for g in grads) and len(grads) == len(outs):
            own = model_loss(out)  # the model's own loss: its gradient holds the rest
            pairs = [(t, g) for t, g in zip(outs, grads, strict=True) if g is not None
                     and t.requires_grad and (own is None or t is own)]
            if pairs:  # the user's backward (scaled as it ran), outside autocast
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
                return
        from ampnb.watcher.overflow import autocast_as

        with autocast_as(self.autocast):
            loss = _loss(out, self.loss_fn)
        # the step's backward (outside autocast): the mode's hook scales the loss, as the
        # kept step's GradScaler did, at the scale it ran at
        scaler = None if self.scale is None else torch.amp.GradScaler(
            loss.device.type, init_scale=self.scale)
        Precision.of("32-true" if scaler is None else "16-mixed", device=loss.device,
                     scaler=scaler).backward(loss.float())

    def _hunt(self, rng: dict[str, Any] | None) -> tuple[int | None, Any]:
        from ampnb.instruments.hunt import find_nonfinite

        found = None
        with rng_kept():  # the caller's RNG is put back afterwards
            if rng is not None:
                Rng.from_dict(rng).restore()
            for k, (entry, batch) in enumerate(zip(self.entries, self.batches)):
                found = find_nonfinite(self._step, entry, batch, self.out_grads[k])
                if found or found.op:
                    self.model.zero_grad(set_to_none=True)
                    return k, found
        self.model.zero_grad(set_to_none=True)
        return None, found

    @cached_property
    def report(self) -> Any:
        """`ampnb.doctor` on the kept micro-batch (the model's own loss, or loss_fn)."""
        from ampnb.diagnosis.core import doctor

        k = self.micro_batch or 0
        entry, batch = self.entries[k], self.batches[k]
        with rng_kept(), torch.no_grad():  # does the model give a loss?
            own = self.loss_fn is None and model_loss(batch.call(entry)) is not None
        loss_fn = None if own else (lambda out, _targets: _loss(out, self.loss_fn))
        return doctor(entry, batch, loss_fn)

    def table(self) -> Table:
        """What was rerun and what the hunter found."""
        ac = ", ".join(f"{d} {str(dt).removeprefix('torch.')}" for d, dt in self.autocast)
        where = (f"micro-batch {self.micro_batch} of {len(self.batches)}"
                 if self.micro_batch is not None else f"none of {len(self.batches)} micro-batches")
        rows = [("step", str(self.step)), ("autocast", ac or "off"),
                ("loss scale", "none" if self.scale is None else f"{self.scale:g}"),
                ("non-finite in", where),
                ("found", self.nonfinite.message if self.nonfinite is not None else "-")]
        return Table(("replayed", "what"), rows, caption=f"replay of {os.fspath(self.path)}")


def replay(path: str | os.PathLike, model: nn.Module | None = None, *,
           loss_fn: Callable[[Any], Any] | None = None,
           trust_pickled_model: bool = False) -> Replay:
    """Rerun the step `ampnb.watch(..., keep_overflow=path)` kept, and name the non-finite op.

    model: a fresh instance of the watched model's class; the kept state is loaded into it.
    loss_fn: loss_fn(output) -> the loss, when the model does not return its own.
    trust_pickled_model: without model=, unpickle the model the file holds (runs code from the
    file: only for a file you trust). The rest of the file is always loaded as data only.
    """
    _check_arguments(path, model, trust_pickled_model)
    data = _load(path)
    return Replay(path, data, _model(data, model, trust_pickled_model), loss_fn)
