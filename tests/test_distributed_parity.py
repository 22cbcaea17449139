"""`%%amp MODE --nproc N` runs the single-process cell's rules on every rank, bit for bit.

Each case runs a seeded cell without collectives on two ranks, then the same cell in this
process at the ranks' thread count (1), and compares every tensor it returned exactly.
"""

from __future__ import annotations

import re

import pytest
import torch
from _magics_kit import amp, shell_with_ampnb
from IPython.core.error import UsageError
from torch.utils._pytree import tree_flatten

from ampnb import set_fp16_kernels

ip = pytest.fixture(shell_with_ampnb)


@pytest.fixture(autouse=True)
def _one_thread():
    """The ranks run with one thread; so does the reference."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


NET = ("torch.manual_seed(0)\n"
       "net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))\n"
       "xs, ys = torch.randn(8, 16), torch.randn(8, 4)\n")

LOOP = ("opt = torch.optim.SGD(net.parameters(), lr=0.05)\n"
        "losses = []\n"
        "for _ in range(STEPS):\n"
        "    opt.zero_grad()\n"
        "    loss = torch.nn.functional.mse_loss(net(xs).float(), ys)\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    losses.append(loss.detach())\n"
        "(losses, [p.detach().clone() for p in net.parameters()])\n")

TWO = ("class Two(torch.nn.Module):\n"
       "    def __init__(self):\n"
       "        super().__init__()\n"
       "        self.body, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)\n"
       "    def forward(self, x):\n"
       "        return self.head(torch.relu(self.body(x)))\n"
       "torch.manual_seed(0)\n"
       "two, xs = Two(), torch.randn(8, 16)\n")

APEX_STEPS = ("opt = torch.optim.SGD([w], lr=2.0 ** -12)\n"
              "for _ in range(8):\n"
              "    opt.zero_grad()\n"
              "    w.sum().backward()\n"
              "    opt.step()\n"
              "w.detach().clone()\n")

FORWARD_BACKWARD = ("out = net(xs)\n"
                    "torch.nn.functional.mse_loss(out.float(), ys).backward()\n"
                    "(out, [p.grad for p in net.parameters()])\n")

# name: (setup run in the notebook first, the %%amp line, the cell)
CASES = {
    "apex-O2 steps fp32 masters": (
        "w = torch.nn.Parameter(torch.tensor([1.5], dtype=torch.float16))\n",
        "apex-O2", APEX_STEPS),
    "bf16-mixed SGD loop": (NET, "bf16-mixed", LOOP.replace("STEPS", "10")),
    "keep-fp32": (TWO, '16-mixed --keep-fp32 "head" --fp16-kernels native',
                  "out = two(xs)\nout.float().pow(2).mean().backward()\n"
                  "(out.dtype, out, [p.grad for p in two.parameters()])\n"),
    "tf32 emulate": (NET, "32-true --tf32 emulate", FORWARD_BACKWARD),
}


def _on_ranks_and_here(ip, setup: str, line: str, cell: str) -> tuple[tuple, object]:
    """(every rank's value, this process's value) for the cell run from the same start."""
    ip.run_cell(setup)
    # One rank where the cell makes an optimizer: its first one imports torch._dynamo, seconds
    # per rank; two elsewhere, to see every rank run the same rules.
    nproc = 1 if "optim" in cell else 2
    amp(ip, f"{line} --nproc {nproc} -q -o run", cell)  # first: the notebook's objects as set up
    run = ip.user_ns["run"]
    assert run.ok, run.ranks
    here, _ = amp(ip, line, cell)
    return run.values, here


def _same(a, b) -> bool:
    """Equal structure, values, and tensors equal in dtype and bits."""
    (la, sa), (lb, sb) = tree_flatten(a), tree_flatten(b)
    if sa != sb or not any(isinstance(t, torch.Tensor) for t in la):
        return False
    return all(x.dtype == y.dtype and torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in zip(la, lb, strict=True))


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_rank_gives_the_single_process_result_bit_for_bit(ip, case):
    ranks, here = _on_ranks_and_here(ip, *CASES[case])
    assert all(_same(r, here) for r in ranks), (ranks, here)
    if case.startswith("apex"):  # the masters keep the quarter-ulp steps fp16 alone loses
        assert float(here) == float(torch.tensor(1.5 - 8 * 2.0 ** -12).half()) != 1.5
    if case == "keep-fp32":
        assert here[0] == torch.float32
    if case == "tf32 emulate":  # the emulation rounded: not what plain fp32 gives
        assert not torch.equal(here[0], ip.user_ns["net"](ip.user_ns["xs"]))


# The product, and how many fp16 products ampnb's kernel emulation ran while the cell did: the
# path shows in the emulation's own count, not in the bits (on a CPU with AVX512-FP16 or AMX the
# native kernels give the same bits as the emulation).
_EMULATED = ("sum(o.emulated_ops for o in ampnb._kernels._active "
             "if isinstance(o, ampnb.fp16_kernels.Fp16KernelEmulation))")
KERNEL_PATH = (f"import ampnb._kernels, ampnb.fp16_kernels\ncounted = {_EMULATED}\nc = a @ b\n"
               f"(c, {_EMULATED} - counted)\n")


def test_16_mixed_runs_the_fp16_kernels_the_notebook_chose(ip):
    """--fp16-kernels emulated, and the notebook's process-wide choice (native) when not given."""
    setup = "torch.manual_seed(0)\na, b = torch.randn(64, 256), torch.randn(256, 64)\n"
    emulated, here_emulated = _on_ranks_and_here(ip, setup, "16-mixed --fp16-kernels emulated",
                                                 KERNEL_PATH)
    before = set_fp16_kernels("native")
    try:
        native, here_native = _on_ranks_and_here(ip, setup, "16-mixed", KERNEL_PATH)
    finally:
        set_fp16_kernels(before)
    assert _same(emulated[0], here_emulated) and _same(native[0], here_native)
    assert all(v[1] == 1 for v in (*emulated, here_emulated))  # the one product ran emulated
    assert all(v[1] == 0 for v in (*native, here_native))  # torch's own fp16 kernel ran
    assert here_native[0].dtype == here_emulated[0].dtype == torch.float16


REFUSED = ["--compare bf16-mixed", "--repeat 3", "--trace", "--trace summary", "--hunt",
           "--memory", "--show-code", "--doctor", "--profile"]


@pytest.fixture
def no_launch(monkeypatch):
    """Fails the test if anything is launched."""
    from ampnb.magics import nproc

    launched = []
    monkeypatch.setattr(nproc, "launch", lambda *a, **k: launched.append(a))
    yield launched
    assert launched == []


@pytest.mark.parametrize("option", REFUSED)
def test_an_option_that_watches_this_kernel_is_refused_by_name(ip, no_launch, option):
    flag = option.split()[0]
    with pytest.raises(UsageError, match=f"^{flag} cannot be combined with --nproc") as e:
        ip.run_cell_magic("amp", f"bf16-mixed --nproc 2 {option}", "lin(x)")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("cell, says", [
    ("y = lin(x)\n%time z = lin(x)\n", "line 2 `%time`"),
    ("%%timeit\nlin(x)\n", "line 1 `%%timeit`"),
    ("!ls\n", "line 1 `!ls`"),
    ("files = !ls\nfiles\n", "line 1 `!ls`"),
    ("%who\n", "line 1 `%who`"),
    ("lin?\n", "line 1 `%pinfo`"),
    ("ip = get_ipython()\n", "line 1 `get_ipython()`"),
    ("def f():\n    %time 1\nf()\n", "line 2 `%time`"),
])
def test_an_ipython_only_line_is_refused_before_launching(ip, no_launch, cell, says):
    with pytest.raises(UsageError, match=re.escape(says) + " needs IPython") as e:
        ip.run_cell_magic("amp", "bf16-mixed --nproc 2", cell)
    assert "\n" not in str(e.value)


def test_keep_fp32_that_names_no_module_is_refused_before_launching(ip, no_launch):
    with pytest.raises(UsageError, match="matches no module"):
        ip.run_cell_magic("amp", '16-mixed --nproc 2 --keep-fp32 "nope"', "lin(x)")
    with pytest.raises(UsageError, match="needs a model made before the cell"):
        ip.run_cell_magic("amp", '16-mixed --nproc 2 --keep-fp32 "head"', "torch.ones(1)")
