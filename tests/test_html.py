"""The shared Table renders deterministically and escapes what it shows."""

from ampnb.display import Table


def test_text_is_aligned_and_stable():
    t = Table(("mode", "ms"), [("32-true", "12.0"), ("bf16-mixed", "7.5")], caption="cap")
    text = repr(t)
    lines = text.splitlines()
    assert lines[0] == "cap"
    assert lines[1].startswith("mode        ms")
    assert lines[2] == "----------  ----"
    assert repr(t) == text == str(t)


def test_html_escapes_cells():
    html = Table(("a",), [("<b>&",)])._repr_html_()
    assert "&lt;b&gt;&amp;" in html and "<b>&" not in html
