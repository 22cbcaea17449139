"""`import ampnb` and the pure core stay light: no IPython, ipywidgets, matplotlib, no probing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

JUPYTER_SIDE = ("IPython", "ipywidgets", "matplotlib")


def run_fresh(code: str, report: bool = False) -> dict:
    """Run code in a fresh interpreter and return the JSON it prints last."""
    code = textwrap.dedent(code) + (REPORT if report else "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


REPORT = f"""
import json, sys
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {set(JUPYTER_SIDE)!r})
ours = sorted(m for m in sys.modules if m == "ampnb" or m.startswith("ampnb."))
print(json.dumps({{"heavy": heavy, "ours": ours}}))
"""


def test_bare_import_loads_only_the_package_init():
    found = run_fresh("import ampnb", report=True)
    assert found["ours"] == ["ampnb"]
    assert found["heavy"] == []


def test_first_public_use_stays_in_the_pure_core():
    found = run_fresh("""
        import ampnb
        fmt = ampnb.get_format("bf16")
        assert fmt.mantissa_bits == 7
    """, report=True)
    assert "ampnb.formats" in found["ours"]
    assert found["heavy"] == []


@pytest.mark.parametrize("modules", ["ampnb.modes, ampnb.device, ampnb.formats", "ampnb.device"])
def test_core_modules_do_not_import_the_jupyter_side(modules):
    found = run_fresh(f"import {modules}", report=True)
    assert found["heavy"] == []


def test_using_the_device_module_stays_in_the_pure_core():
    found = run_fresh("""
        import ampnb
        repr(ampnb.support_table())
        with ampnb.tf32(True):
            pass
        ampnb.device.matmul_throughput("cpu", "fp32", 32)
    """, report=True)
    assert found["heavy"] == []


def test_importing_the_core_probes_no_hardware():
    found = run_fresh("""
        import json, torch
        calls = []
        def spy(name, real):
            def probe(*args, **kwargs):
                calls.append(name)
                return real(*args, **kwargs)
            return probe
        torch.cuda.is_available = spy("cuda.is_available", torch.cuda.is_available)
        torch.cuda.device_count = spy("cuda.device_count", torch.cuda.device_count)
        torch.backends.mps.is_available = spy("mps.is_available", torch.backends.mps.is_available)
        torch.backends.cpu.get_cpu_capability = spy("cpu capability",
                                                    torch.backends.cpu.get_cpu_capability)
        import ampnb, ampnb.device, ampnb.modes, ampnb.formats
        at_import = list(calls)
        ampnb.device.devices()
        print(json.dumps({"at_import": at_import, "after_use": calls}))
    """)
    assert found["at_import"] == []
    assert "cuda.is_available" in found["after_use"]  # the spy works: devices() does probe
