"""Lightning 1.x's precision spellings (`Trainer(gpus=1, precision=16, amp_backend="apex")`) and
what each means today: pure data, one resolver, no torch."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from ampnb.display import Table, TableView

LEVELS = ("O0", "O1", "O2", "O3")
DEFAULT_APEX_LEVEL = "O2"  # Lightning 1.x's ApexMixedPrecisionPlugin(amp_level="O2")
_ON_CPU = ("on a CPU Lightning runs bf16 autocast instead, with a warning; ampnb's %%amp runs "
           "real fp16 there")
_ON_TPU = ("on a TPU it meant bf16: Lightning 1.x set XLA_USE_BF16=1, storing every float tensor "
           "in bf16 — what precision=\"bf16-true\" does on XLA today")


@dataclass(frozen=True)
class Meaning:
    """One old spelling: what it is today (a Lightning 2.x spelling) and what to know about it."""

    today: str
    note: str
    mode: str | None = None  # the ampnb mode it selects, None when it says nothing about precision


# precision=... as Lightning 1.x took it.
PRECISION: dict[Any, Meaning] = {
    16: Meaning('precision="16-mixed"', "Lightning 2.x still takes 16 but asks for \"16-mixed\"; "
                + _ON_CPU + "; " + _ON_TPU, "16-mixed"),
    "bf16": Meaning('precision="bf16-mixed"', "fp32 weights, bf16 autocast, no GradScaler; " + _ON_TPU,
                    "bf16-mixed"),
    32: Meaning('precision="32-true"', "fp32, the default", "32-true"),
    64: Meaning('precision="64-true"', "fp64 everywhere", "64-true"),
}
PRECISION.update({str(k): v for k, v in PRECISION.items() if isinstance(k, int)})

# Lightning 2.x's own spellings (its _PRECISION_INPUT_STR), read as they are.
TODAY = ("transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true",
         "bf16-mixed", "32-true", "64-true")

# APEX's opt levels, as amp_level with amp_backend="apex" (removed in Lightning 2.0).
APEX: dict[str, Meaning] = {
    "O0": Meaning('precision="32-true"', "fp32 training", "apex-O0"),
    "O1": Meaning('precision="16-mixed"', "autocast-like casts per op (APEX's own op lists) and "
                  "dynamic loss scaling: native AMP is its direct successor", "apex-O1"),
    "O2": Meaning('precision="16-mixed"', "fp16 weights except batch norm, fp32 master weights in "
                  "the optimizer, dynamic loss scaling; native AMP keeps the weights themselves "
                  "in fp32 (they are the masters) and casts per op", "apex-O2"),
    "O3": Meaning('precision="16-true"', "pure fp16: no master weights, loss scale 1", "apex-O3"),
}

BACKENDS: dict[str, Meaning] = {
    "native": Meaning("(nothing: native AMP is the only backend)", "torch.cuda.amp / torch.amp"),
    "apex": Meaning("(removed in Lightning 2.0)", "NVIDIA APEX amp, legacy; ampnb emulates its "
                    "opt levels with native torch as apex-O0 ... apex-O3"),
}
ARGUMENTS = ("precision", "amp_backend", "amp_level", "gpus", "tpu_cores", "accelerator", "devices")


def _allowed(name: str, value: Any, allowed: Any) -> ValueError:
    return ValueError(f"{name}={value!r} is not allowed; allowed: "
                      f"{', '.join(repr(a) for a in allowed)}")


@dataclass(frozen=True, repr=False)
class LegacyPrecision(TableView):
    """What a Lightning 1.x Trainer's precision arguments meant, and the ampnb mode that runs it."""

    call: str
    today: str
    mode: str
    rows: tuple[tuple[str, str, str], ...]

    def table(self) -> Table:
        return Table(("you wrote", "today", "note"), self.rows,
                     caption=f"{self.call} -> today {self.today}; ampnb mode {self.mode!r}")


def _precision(value: Any, tpu: bool) -> tuple[Meaning, str]:
    key = value.strip().lower() if isinstance(value, str) else value
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise _allowed("precision", value, PRECISION)
    if key in PRECISION:
        found = PRECISION[key]
        mode = "bf16-true" if tpu and found.mode in ("16-mixed", "bf16-mixed") else found.mode
        return found, mode
    if key in TODAY:  # already today's spelling
        return Meaning(f"precision={key!r}", "today's spelling", key), key
    raise _allowed("precision", value, (*PRECISION, *TODAY))


def explain_precision(**trainer_kwargs: Any) -> LegacyPrecision:
    """Lightning 1.x Trainer arguments -> their meaning today and the ampnb mode that runs them."""
    unknown = sorted(set(trainer_kwargs) - set(ARGUMENTS))
    if unknown:
        raise _allowed("argument " + unknown[0], trainer_kwargs[unknown[0]], ARGUMENTS)
    kw = dict(trainer_kwargs)
    accelerator = str(kw.get("accelerator") or "").lower()
    tpu = accelerator == "tpu" or bool(kw.get("tpu_cores"))
    rows, today = [], {}
    if kw.get("gpus") not in (None, 0):
        rows.append((f"gpus={kw['gpus']!r}", f'accelerator="gpu", devices={kw["gpus"]!r}',
                     "gpus= was removed in Lightning 2.0"))
        today.update(accelerator='"gpu"', devices=repr(kw["gpus"]))
    if kw.get("tpu_cores"):
        rows.append((f"tpu_cores={kw['tpu_cores']!r}", f'accelerator="tpu", devices={kw["tpu_cores"]!r}',
                     "tpu_cores= was removed in Lightning 2.0"))
        today.update(accelerator='"tpu"', devices=repr(kw["tpu_cores"]))
    for name in ("accelerator", "devices"):
        if kw.get(name) is not None:
            today[name] = repr(kw[name])
    precision = kw.get("precision", 32)
    meaning, mode = _precision(precision, tpu)
    note = meaning.note + ("" if mode == meaning.mode else f" (this call names a TPU: {mode})")
    rows.append((f"precision={precision!r}", meaning.today if mode == meaning.mode
                 else f'precision="{mode}" (on a TPU)', note))
    today["precision"] = meaning.today.split("=", 1)[1] if mode == meaning.mode else f'"{mode}"'
    backend, level = kw.get("amp_backend"), kw.get("amp_level")
    if backend is not None:
        if not isinstance(backend, str) or backend not in BACKENDS:
            raise _allowed("amp_backend", backend, BACKENDS)
        rows.append((f"amp_backend={backend!r}", BACKENDS[backend].today, BACKENDS[backend].note))
    if level is not None:
        if backend != "apex":
            raise ValueError(f"amp_level={level!r} is not allowed without amp_backend='apex' "
                             "(Lightning 1.x refused it too); allowed: amp_backend='apex'")
        level = level.upper() if isinstance(level, str) else level
        if not isinstance(level, str) or level not in LEVELS:
            raise _allowed("amp_level", kw["amp_level"], LEVELS)
    if backend == "apex" and mode == "16-mixed":  # Lightning 1.x used APEX only for precision=16
        level = level or DEFAULT_APEX_LEVEL
        found = APEX[level]
        rows.append((f"amp_level={level!r}" + ("" if kw.get("amp_level") else " (the default)"),
                     found.today, found.note))
        mode = found.mode
        today["precision"] = found.today.split("=", 1)[1]
    elif backend == "apex":
        rows.append(("amp_backend='apex'", "(ignored)", "Lightning 1.x used APEX only with "
                     f"precision=16 on a GPU; precision={precision!r} here does not use it"))
    call = "Trainer(" + ", ".join(f"{k}={v!r}" for k, v in trainer_kwargs.items()) + ")"
    now = "Trainer(" + ", ".join(f"{k}={v}" for k, v in today.items()) + ")"
    return LegacyPrecision(call, now, mode, tuple(rows))


def parse_call(text: str) -> dict[str, Any]:
    """'Trainer(gpus=1, precision=16)' (or 'L.Trainer(...)', 'Fabric(...)', or just the keywords)
    -> its keyword arguments, read as literals (nothing is executed)."""
    source = text.strip()
    if len(source) > 1 and source[0] == source[-1] and source[0] in "'\"":
        source = source[1:-1]  # a %%amp line keeps the quotes around a call with spaces
    if "(" not in source:
        source = f"Trainer({source})"
    try:
        call = ast.parse(source, mode="eval").body
        if not isinstance(call, ast.Call) or call.args:
            raise SyntaxError
        return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
    except (SyntaxError, ValueError):
        raise ValueError(f"cannot read {text!r} as Lightning arguments; allowed: keyword literals "
                         "such as \"Trainer(gpus=1, precision=16, amp_backend='apex')\"") from None


def resolve(text: str) -> str:
    """The ampnb mode name an old Trainer spelling selects (ValueError when it is not one)."""
    return explain_precision(**parse_call(text)).mode


def code_notes(spelled: Any, mode_name: str) -> list[str]:
    """Comment lines for --show-code when the mode was asked for by an older spelling."""
    key = spelled.strip() if isinstance(spelled, str) else spelled
    if key is None or (isinstance(key, str) and key.lower() == mode_name.lower()):
        return []
    if isinstance(key, str) and "=" in key:
        found = explain_precision(**parse_call(key))
        return [f"# You wrote {found.call}; today: {found.today}"] + [
            f"#   {wrote}: {today} — {note}" for wrote, today, note in found.rows]
    lookup = key.lower() if isinstance(key, str) else key
    if lookup in PRECISION:
        found = PRECISION[lookup]
        return [f"# You wrote {key!r}: Lightning 1.x's precision={key!r}; today {found.today}",
                f"#   {found.note}"]
    return []


def apex_code(mode_name: str) -> list[str]:
    """What an apex-O* mode was in APEX and Lightning 1.x, and what replaced it (comment lines)."""
    level = mode_name.removeprefix("apex-")
    found = APEX[level]
    return [f"# Legacy: APEX {level} ({found.note}).",
            "#   from apex import amp",
            f'#   model, optimizer = amp.initialize(model, optimizer, opt_level="{level}")',
            "#   with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()",
            f'#   Lightning 1.x: Trainer(gpus=1, precision=16, amp_backend="apex", amp_level="{level}")',
            f"# Today (APEX was removed in Lightning 2.0): L.Trainer({found.today})"]


APEX_MODES = frozenset(m.mode for m in APEX.values())


def apex_body(mode_name: str, cell: str) -> list[str]:
    """apex-O2's plain-torch code around a cell (other modes: [] for the usual body)."""
    if mode_name != APEX["O2"].mode:
        return []
    return ["# apex-O2: the model in fp16 except batch norm (ampnb: model = ampnb.get_mode(",
            '# "apex-O2").convert_module(model)), the optimizer stepping fp32 master weights:',
            "fp16_params = [p for p in model.parameters() if p.dtype == torch.float16]",
            "masters = [p.detach().float() for p in fp16_params]  # once; the optimizer holds these",
            "scaler = torch.amp.GradScaler()  # APEX's dynamic loss scale: 2**16, x2 per 2000 clean steps",
            cell.strip() or "pass",
            "# each step: scaler.scale(loss).backward(); then for m, p: m.grad = p.grad.float();",
            "# scaler.step(optimizer) (unscales the fp32 grads, skips on inf); scaler.update();",
            "# with torch.no_grad(): p.copy_(m) for each pair (rounds the masters into the fp16 model)"]
