"""`%%amp` and `%amp`: parse, check, call the core, display. No numeric logic lives here."""

from __future__ import annotations

import keyword
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display
from traitlets import Integer, TraitError, Unicode, validate

from ampnb.device import Placement
from ampnb.magics import compare_cell, runs
from ampnb.magics.cell import compile_cell
from ampnb.step import StepSettings

_CELL_ONLY = ("compare", "repeat", "trace", "hunt", "memory", "show_code", "output", "doctor",
              "profile", "fp16_kernels", "keep_fp32", "nproc", "timeout")
_ONE_RUN_ONLY = ("trace", "hunt", "memory", "show_code")
# What watches or repeats this kernel's run, or holds its objects: no meaning on --nproc ranks.
_NOT_ON_RANKS = ("compare", "repeat", "trace", "hunt", "memory", "show_code", "doctor", "profile")
_NPROC_TIMEOUT = 300  # seconds a cell's ranks may run before all are stopped


def _flag(name: str) -> str:
    return {"output": "-o"}.get(name, "--" + name.replace("_", "-"))


@magics_class
class AmpMagics(Magics):
    """The %%amp cell magic and %amp line magic (defaults settable with %config AmpMagics)."""

    default_mode = Unicode("32-true", help="Mode of %%amp when none is given.").tag(config=True)
    default_device = Unicode(
        "auto", help="Device of %%amp: 'auto' (where the cell's models and tensors are), or a "
        "statement they must agree with: 'cpu', 'cuda:N', 'mps'."
    ).tag(config=True)
    default_tf32 = Unicode(
        "", help="TF32 of %%amp: '' leaves the flags as they are, or 'on', 'off', 'emulate'."
    ).tag(config=True)
    default_repeat = Integer(5, help="Timed runs per mode for %%amp --compare.").tag(config=True)

    @validate("default_mode")
    def _valid_mode(self, proposal: dict) -> str:
        return _or_trait_error(runs.mode_name, proposal["value"])

    @validate("default_device")
    def _valid_device(self, proposal: dict) -> str:
        value = proposal["value"]
        return value if value == "auto" else _or_trait_error(runs.device_name, value)

    @validate("default_tf32")
    def _valid_tf32(self, proposal: dict) -> str:
        return _or_trait_error(lambda v: runs.tf32_setting(v) or "", proposal["value"])

    @validate("default_repeat")
    def _valid_repeat(self, proposal: dict) -> int:
        if proposal["value"] < 1:
            raise TraitError(f"default_repeat must be >= 1, got {proposal['value']}")
        return proposal["value"]

    @magic_arguments("%amp")
    @argument("mode", nargs="?", help="precision mode: 32-true, 16-mixed, bf16-mixed, 16-true, "
              "bf16-true, 64-true (or 16, bf16, 32, 64). %%%%amp: run the cell under it; "
              "%%amp: make it the default.")
    @argument("--device", "-d", help="cpu, cuda, cuda:N or mps: states where the cell's models "
              "and tensors are (an error if they are elsewhere); default: where they are")
    @argument("--tf32", choices=("on", "off", "emulate"),
              help="TF32 for fp32 matmuls/convs; 'emulate' rounds their inputs to TF32 on any device")
    @argument("--compare", metavar="M1,M2", help="run the cell under 32-true and these modes "
              "from the same start; table of median time, speedup, memory and error")
    @argument("--repeat", "-r", type=int, help="timed runs per mode for --compare (default 5)")
    @argument("--fp16-kernels", choices=("auto", "native", "emulated"),
              help="how fp16 products run on a CPU: emulated in fp32 as tensor cores do (auto's "
                   "choice where the CPU has no fp16 units) or torch's native kernels")
    @argument("--keep-fp32", metavar="PATHS", help="module paths or globs run in fp32 in any "
              "mode, e.g. \"lm_head,*.norm\" (in the models the cell uses)")
    @argument("--trace", nargs="?", const="full", choices=("full", "summary"), metavar="full|summary",
              help="table of which op ran in which dtype: per module (full, the default) or "
              "counts per op only (summary: several times cheaper)")
    @argument("--hunt", action="store_true", help="report the first op that made inf/NaN")
    @argument("--memory", action="store_true", help="activation memory saved for backward")
    @argument("--show-code", action="store_true",
              help="the plain torch.amp code, and Lightning / Accelerate settings, for this run")
    @argument("--doctor", action="store_true", help="run the cell's loss as a training step in "
              "every mode this machine can run; evidence and a recommendation (ampnb.doctor)")
    @argument("--profile", action="store_true", help="why each mode is (not) faster here, from "
              "torch.profiler: op time by dtype, casts, matmul sizes")
    @argument("--nproc", type=int, metavar="N", help="run the cell on N local ranks (torch's "
              "elastic launcher; gloo on CPU, NCCL on CUDA); the cell gets rank, world_size, "
              "device and mode; output comes back labelled by rank")
    @argument("--timeout", metavar="SECONDS", help="with --nproc: stop every rank after SECONDS "
              f"(default {_NPROC_TIMEOUT}) and say which were still running and what they "
              "printed last")
    @argument("--measure", action="store_true", help="%%amp only: re-measure matmul throughput")
    @argument("-o", dest="output", metavar="NAME", help="store the result object in NAME")
    @argument("-q", "--quiet", action="store_true", help="print nothing")
    @line_cell_magic
    def amp(self, line: str = "", cell: str | None = None) -> Any:
        """Run a cell under a precision mode (%%amp), or show and set defaults (%amp).

        %%amp bf16-mixed             run the cell under bf16 autocast
        %%amp --compare bf16-mixed   time and check it against 32-true
        %amp                         defaults, devices, support table, matmul throughput
        %amp bf16-mixed              make bf16-mixed the default of %%amp
        """
        __tracebackhide__ = True  # noqa: F841 - keep the user's traceback about their cell
        args = parse_argstring(self.amp, line)
        if cell is None:
            return self._line(args)
        return self._cell(args, cell)

    def _line(self, args: Any) -> None:
        used = [_flag(n) for n in _CELL_ONLY if getattr(args, n)]
        if used:
            raise UsageError(f"{', '.join(used)} only work in a %%amp cell; %amp takes MODE, "
                             "--device, --tf32, --measure, -q")
        wanted = {trait: value for trait, value in (("default_mode", args.mode),
                                                    ("default_device", args.device),
                                                    ("default_tf32", args.tf32)) if value is not None}
        if wanted:  # check the new defaults together before setting any of them
            try:
                runs.settings(wanted.get("default_mode", self.default_mode),
                              wanted.get("default_device", self.default_device),
                              wanted.get("default_tf32", self.default_tf32))
            except ValueError as e:
                raise UsageError(str(e)) from None
        changed = []
        for trait, value in wanted.items():
            setattr(self, trait, value)
            changed.append(f"{trait} = {getattr(self, trait)!r}")
        if changed and not args.measure:
            if not args.quiet:
                print("%%amp defaults: " + ", ".join(changed))
            return
        from ampnb.magics.status import status

        shown = status(self._defaults(), measure=args.measure)
        if not args.quiet:
            display(shown)

    def _defaults(self) -> dict[str, object]:
        device = self.default_device
        return {"mode": self.default_mode,
                "device": "auto (where the cell's models and tensors are)" if device == "auto"
                else f"{device} (stated: the cell's models and tensors must be there)",
                "tf32": self.default_tf32 or "as is", "repeat": self.default_repeat}

    def _cell(self, args: Any, cell: str) -> Any:
        __tracebackhide__ = True  # noqa: F841
        if args.measure:
            raise UsageError("--measure belongs to %amp (a line); %%amp runs a cell")
        if args.output is not None and (not args.output.isidentifier() or keyword.iskeyword(args.output)):
            raise UsageError(f"-o needs a Python name to store the result in, got {args.output!r}")
        if args.timeout is not None and args.nproc is None:
            raise UsageError("--timeout sets how long the ranks of --nproc N may run; add --nproc N")
        if args.nproc is not None:
            return self._nproc(args, cell)
        if args.doctor or args.profile:
            return self._diagnose(args, cell)
        if args.compare is None:
            if args.repeat is not None:
                raise UsageError("--repeat sets the runs of --compare; add --compare M1,M2")
            where = self._placement(args, cell)
            run = runs.run_once(self.shell, cell, self._settings(args, where), args, where)
        else:
            used = [_flag(n) for n in _ONE_RUN_ONLY if getattr(args, n)]
            if args.mode is not None or used:
                what = ", ".join(([f"MODE {args.mode!r}"] if args.mode else []) + used)
                raise UsageError(f"{what} cannot be combined with --compare; list the modes in "
                                 "--compare and use the rest on a single-mode %%amp")
            repeat = self.default_repeat if args.repeat is None else args.repeat
            if repeat < 1:
                raise UsageError(f"--repeat must be >= 1, got {repeat}")
            where = self._placement(args, cell)
            run = compare_cell.run_compare(self.shell, cell, self._settings(args, where),
                                           args.compare, repeat, quiet=args.quiet, where=where)
        if args.output:
            self.shell.user_ns[args.output] = run
        if args.quiet:
            return None
        display(run)
        return run.value if args.compare is None else None

    def _diagnose(self, args: Any, cell: str) -> Any:
        """--doctor or --profile: the cell's step in every mode (ampnb.doctor)."""
        from ampnb.magics.doctor import doctor_cell, profile_cell

        flag = "--doctor" if args.doctor else "--profile"
        others = [_flag(n) for n in ("compare", "repeat", "trace", "hunt", "memory", "show_code",
                                     "tf32", "fp16_kernels", "keep_fp32") if getattr(args, n)]
        if args.doctor and args.profile:
            others.insert(0, "--profile")
        if args.mode is not None or others:
            what = ", ".join(([f"MODE {args.mode!r}"] if args.mode else []) + others)
            raise UsageError(f"{what} cannot be combined with {flag}; it runs every mode this "
                             "machine can run (use --device to pick the device)")
        self._settings(args)  # checks the stated device; the doctor takes the model's and checks it
        device = args.device if args.device is not None else (
            None if self.default_device == "auto" else self.default_device)
        if args.doctor:
            result = doctor_cell(self.shell, cell, device=device)
        else:
            result = profile_cell(self.shell, cell, device=device)
        if args.output:
            self.shell.user_ns[args.output] = result
        if not args.quiet:
            display(result)
        return None

    def _nproc(self, args: Any, cell: str) -> Any:
        """--nproc N: the cell on N local ranks, each in the cell's one context (ampnb.magics.nproc)."""
        from ampnb.distributed._ship import RankSettings
        from ampnb.magics.nproc import nproc_cell

        used = [_flag(n) for n in _NOT_ON_RANKS if getattr(args, n)]
        if used:
            raise UsageError(f"{', '.join(used)} cannot be combined with --nproc (they watch or "
                             "repeat this kernel's own run, not the ranks'); with --nproc a cell "
                             "takes MODE, --device, --tf32, --fp16-kernels, --keep-fp32, "
                             "--timeout, -o and -q")
        s = self._settings(args, self._placement(args, cell, ranks=True))
        if s.keep_fp32:  # the ranks find the same models; say what is wrong before launching
            try:
                runs.kept_modules(s, self.shell.user_ns, compile_cell(self.shell, cell).names)
            except ValueError as e:
                raise UsageError(str(e)) from None
        timeout = _NPROC_TIMEOUT if args.timeout is None else args.timeout
        run = nproc_cell(self.shell, cell, RankSettings.of(s), s.device, args.nproc,
                         quiet=args.quiet, timeout=timeout)
        if args.output:
            self.shell.user_ns[args.output] = run
        if not args.quiet:
            display(run)
        return None

    def _settings(self, args: Any, where: Placement | None = None) -> StepSettings:
        mode = self.default_mode if args.mode is None else args.mode
        device = self.default_device if args.device is None else args.device
        tf32 = (self.default_tf32 or None) if args.tf32 is None else args.tf32
        try:
            return runs.settings(mode, device if where is None else where.device, tf32,
                                 args.fp16_kernels, args.keep_fp32)
        except ValueError as e:
            raise UsageError(str(e)) from None

    def _placement(self, args: Any, cell: str, ranks: bool = False) -> Placement:
        """Where the cell runs: where its models and tensors are; --device only states it."""
        device = self.default_device if args.device is None else args.device
        try:
            return runs.placement(device, self.shell.user_ns, compile_cell(self.shell, cell).names,
                                  ranks)
        except ValueError as e:
            raise UsageError(str(e)) from None


def _or_trait_error(check: Any, value: Any) -> Any:
    try:
        return check(value)
    except ValueError as e:
        raise TraitError(str(e)) from None


def load(shell: Any) -> AmpMagics:
    """Register the magics on a shell; returns the instance (for unload)."""
    magics = AmpMagics(shell=shell)
    shell.register_magics(magics)
    return magics


def unload(shell: Any, magics: AmpMagics) -> None:
    """Remove %amp/%%amp, the registry entry and the %config entry that load added."""
    for kind in ("line", "cell"):
        table = shell.magics_manager.magics[kind]
        if getattr(table.get("amp"), "__self__", None) is magics:
            del table["amp"]
    registry = shell.magics_manager.registry
    if registry.get(type(magics).__name__) is magics:
        del registry[type(magics).__name__]
    if magics in shell.configurables:
        shell.configurables.remove(magics)

