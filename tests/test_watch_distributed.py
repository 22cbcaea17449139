"""ampnb.watch under torch.distributed: 2 gloo ranks, DDP, fp16 autocast, an inf on rank 1 only."""

from __future__ import annotations

from ampnb.distributed import run_distributed
from ampnb.watchlog import read_log
from ampnb.watchlog.records import log_path
from ampnb.watchlog.table import summarize

K = 2       # the step at which rank 1's micro-batch overflows
STEPS = 4

# Runs on each rank (the launcher gives rank, world_size and an initialized gloo group).
RANK = """\
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
import ampnb
from ampnb.formats import get_format

class Spike(nn.Linear):
    def __init__(self):
        super().__init__(16, 16)
        self.calls = 0

    def forward(self, x):
        out = super().forward(x)
        self.calls += 1
        if rank == 1 and self.calls - 1 == k:
            out = out * (4 * get_format("fp16").max)  # inf in fp16, on rank 1 only
        return out

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Spike(), nn.Linear(16, 1))
model = DistributedDataParallel(net)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
g = torch.Generator().manual_seed(100 + rank)
scales = []
with ampnb.watch(model, opt, scaler, log_dir=log_dir) as w:
    for step in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
(scales, [r.to_json() for r in w.records])
"""


def test_each_rank_logs_its_own_records_and_rank_1_overflowed_first(tmp_path):
    run = run_distributed(RANK, 2, device="cpu", show_output=False, timeout=120,
                          namespace={"log_dir": str(tmp_path), "k": K, "steps": STEPS})
    for rank in (0, 1):
        assert log_path(tmp_path, rank).is_file()
    records = read_log(tmp_path)
    assert [(r.step, r.rank) for r in records] == [(s, r) for s in range(STEPS) for r in (0, 1)]
    # the log holds what each rank's watch recorded
    assert [r.to_json() for r in records if r.rank == 1] == run.values[1][1]

    by = {(r.step, r.rank): r for r in records}
    # the scaler's skip is the same on both ranks: the all-reduce spread rank 1's inf
    assert [by[s, 0].skipped for s in range(STEPS)] == [s == K for s in range(STEPS)]
    assert [by[s, 1].skipped for s in range(STEPS)] == [s == K for s in range(STEPS)]
    for rank in (0, 1):  # each record's scale is the one its backward ran at, halved after K
        scales = run.values[rank][0]
        assert [by[s, rank].scale for s in range(1, STEPS)] == scales[:-1]
        assert by[K + 1, rank].scale == by[K, rank].scale / 2
    one, zero = by[K, 1], by[K, 0]
    # rank 1 names the module whose forward made the inf; rank 0's forward was finite, it only
    # received the inf in the all-reduced gradients
    assert one.nonfinite and one.first_module == "2" and one.first_phase == "forward"
    assert zero.first_phase != "forward"
    assert all(not by[s, r].nonfinite for s in range(STEPS) for r in (0, 1) if s != K)

    (step,) = [s for s in summarize(records) if s.step == K]
    assert step.skipped == (0, 1) and step.skip_agrees and step.nonfinite in ((1,), (0, 1))
    # the table names the rank whose forward overflowed, whatever order the ranks ended in
    assert step.first_rank == 1 and step.first_module == "2" and step.first_phase == "forward"
