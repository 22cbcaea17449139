"""The shared fixture of the %%amp tests: a real InteractiveShell with ampnb loaded."""

from __future__ import annotations

import torch
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from ampnb import putback_state


def shell_with_ampnb():
    """A real InteractiveShell with ampnb loaded, lin and x in it; state checked afterwards."""
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ampnb")
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(8, 16, generator=g))
    shell.user_ns.update(torch=torch, lin=lin, x=torch.randn(4, 16, generator=g))
    before = putback_state.torch_state()
    names = set(shell.user_ns)
    yield shell
    shell.run_line_magic("unload_ext", "ampnb")
    for name in set(shell.user_ns) - names:
        shell.user_ns.pop(name, None)
    for name in ("y", "r", "c", "z", "made", "opt", "model", "loss"):
        shell.user_ns.pop(name, None)
    assert putback_state.torch_state() == before


def amp(ip, line, cell):
    with capture_output() as out:
        value = ip.run_cell_magic("amp", line, cell)
    return value, out


def shown(out) -> str:
    """Everything a cell printed or displayed, as plain text."""
    return out.stdout + "".join(o.data.get("text/plain", "") for o in out.outputs)


def loaded_shell():
    """A shared InteractiveShell with ampnb loaded (for module-scoped fixtures), unloaded after."""
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ampnb")
    yield shell
    shell.run_line_magic("unload_ext", "ampnb")


def load_script(path, name: str):
    """A script outside the package (binder/url.py, notebooks/src/build.py) as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
