"""The support table's spec columns: accelerators that are absent, from their documents, labelled
so, each cell sourced, and the CUDA ones agreeing with what ampnb decides for such a GPU."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from ampnb.device import SOURCES, devices, spec_columns, support_table
from ampnb.device.hardware import DeviceInfo, _format_support, _support_on
from ampnb.device.spec import CUDA_CAPABILITIES, LABEL, STATUSES, cuda_cell
from ampnb.formats import FORMATS, get_format
from ampnb.modes import MODES, get_mode

ROWS = (*MODES, *FORMATS)
SPEC_HEADERS = ["cuda 7.0 (spec)", "cuda 8.0 (spec)", "cuda 8.9 (spec)", "cuda 9.0 (spec)",
                "tpu (spec)", "ipu (spec)"]


def _status(found) -> str:
    """ampnb's live Support in the spec's words."""
    if not found.ok:
        return "not supported"
    return "native" if found.native else "emulated"


# ---------------------------------------------------------------- the data


def test_every_spec_column_has_every_row_of_the_live_table():
    columns = spec_columns()
    assert [c.header for c in columns] == SPEC_HEADERS
    for column in columns:
        assert set(column.cells) == set(ROWS), column.header


def test_every_cell_has_a_status_a_reason_and_a_named_source():
    for column in spec_columns():
        for row, cell in column.cells.items():
            assert cell.status in STATUSES, (column.header, row)
            assert cell.reason and cell.reason == cell.reason.strip(), (column.header, row)
            assert cell.sources and all(key in SOURCES for key in cell.sources), (column.header, row)


def test_every_source_is_a_document_and_says_something():
    for key, source in SOURCES.items():
        assert re.fullmatch(r"https://[\w.-]+/\S*", source.url), key
        assert len(source.says) > 20, key
    used = {key for c in spec_columns() for cell in c.cells.values() for key in cell.sources}
    assert used == set(SOURCES)  # no source cited by nothing


@pytest.mark.parametrize(("row", "expected"), [
    ("fp16", ("native", "native", "native", "native")),
    ("bf16", ("emulated", "native", "native", "native")),
    ("tf32", ("not supported", "native", "native", "native")),
    ("fp8_e4m3", ("emulated", "emulated", "native", "native")),
    ("transformer-engine", ("emulated", "emulated", "native", "native")),
])
def test_cuda_columns_by_capability(row, expected):
    assert tuple(cuda_cell(row, cc).status for cc in CUDA_CAPABILITIES) == expected


def test_tpu_and_ipu_follow_lightnings_documents():
    tpu, ipu = spec_columns()[-2:]
    assert tpu.cells["bf16-true"].status == tpu.cells["bf16"].status == "native"
    # Lightning 2.x's XLAPrecision: 32-true, 16-true, bf16-true and nothing else
    offered = {m for m in MODES if tpu.cells[m].status in ("native", "emulated")}
    assert offered == {"32-true", "16-true", "bf16-true"}
    # Lightning 1.x's table: 16 and 32 on IPU, neither BFloat16 nor 64
    assert {m: ipu.cells[m].status for m in ("16-mixed", "32-true", "bf16-mixed", "64-true")} == {
        "16-mixed": "native", "32-true": "native", "bf16-mixed": "not supported",
        "64-true": "not supported"}
    assert tpu.cells["tf32"].status == ipu.cells["tf32"].status == "n/a"


# ---------------------------------------------------------------- agreement with ampnb's logic


def _gpu(cc: tuple[int, int]) -> DeviceInfo:
    return DeviceInfo("cuda:0", "cuda", "a GPU of the specification", cc)


@pytest.mark.parametrize("cc", CUDA_CAPABILITIES)
@pytest.mark.parametrize("name", list(FORMATS))
def test_cuda_format_cells_agree_with_ampnbs_decision_from_the_capability(name, cc):
    assert cuda_cell(name, cc).status == _status(_format_support(get_format(name), _gpu(cc)))


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda answering as one present GPU of a given capability, Transformer Engine installed:
    the modes' own availability code runs as it would there."""
    def install(cc: tuple[int, int]) -> DeviceInfo:
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: cc)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "a GPU of the specification")
        # torch's own answer: True from 8.0, and below it with emulation (its default)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *_, **__: True)
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
            importlib.machinery.ModuleSpec(name, None) if name == "transformer_engine"
            else find_spec(name, *a)))
        return _gpu(cc)
    return install


@pytest.mark.parametrize("cc", CUDA_CAPABILITIES)
@pytest.mark.parametrize("name", list(MODES))
def test_cuda_mode_cells_agree_with_ampnbs_modes_on_such_a_gpu(name, cc, fake_gpu):
    dev = fake_gpu(cc)
    found = _support_on(get_mode(name), dev)
    assert cuda_cell(name, cc).status == _status(found), found


def test_the_capability_thresholds_in_code_match_the_documents():
    from ampnb.device.hardware import _FP8_MATMUL_CC, AMPERE_CC
    from ampnb.device.spec import CUDA_NEEDS
    from ampnb.fp8.te import MIN_CAPABILITY

    assert CUDA_NEEDS["fp8_e4m3"].since == CUDA_NEEDS["transformer-engine"].since
    assert CUDA_NEEDS["fp8_e4m3"].since == _FP8_MATMUL_CC == MIN_CAPABILITY == (8, 9)
    assert CUDA_NEEDS["bf16"].since == CUDA_NEEDS["tf32"].since == AMPERE_CC == (8, 0)


# ---------------------------------------------------------------- the rendered table


def test_spec_columns_are_there_on_this_machine_and_labelled():
    table = support_table()
    present = [d.name for d in devices()]
    assert list(table.headers) == ["mode / format", *present, *SPEC_HEADERS]
    assert LABEL == "from the specification, not measured here"
    assert LABEL in table.caption and any(LABEL in note for note in table.notes)
    assert list(support_table(spec=False).headers) == ["mode / format", *present]


def test_every_spec_cell_names_a_note_and_every_note_its_source():
    table = support_table()
    first = len(table.headers) - len(SPEC_HEADERS)
    notes = {m.group(1): m.group(2) for n in table.notes
             if (m := re.fullmatch(r"\[(\d+)\] .* \(source: (.+)\)", n))}
    shown = {n.split(":", 1)[0] for n in table.notes if n.split(":", 1)[0] in SOURCES}
    for row in table.rows:
        for cell in row[first:]:
            status, number = re.fullmatch(r"(.+) \[(\d+)\]", cell).groups()
            assert status in STATUSES
            assert all(key in shown for key in notes[number].split(", "))
    for key in shown:
        assert any(n.startswith(f"{key}: {SOURCES[key].url} — ") for n in table.notes)


def test_text_and_html_are_deterministic():
    a, b = support_table(), support_table()
    assert repr(a) == repr(b) and a._repr_html_() == b._repr_html_()
    html = a._repr_html_()
    assert all(f"<th>{h}</th>" in html for h in SPEC_HEADERS)
    assert "https://nvidia.github.io/TransformerEngine/support_matrix.html" in html
