"""Drive one notebook in JupyterLab: open it, wait for the kernel, run all, read its errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat

# The notebook panel JupyterLab shows, found through the app the server exposes.
_NB = "window.jupyterapp.shell.currentWidget"
_KERNEL_IDLE = f"""() => {{
  const w = {_NB};
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!(k && k.status === 'idle' && w.content && w.content.widgets.length);
}}"""
_BUSY_PROMPTS = """() => [...document.querySelectorAll('.jp-Notebook .jp-InputArea-prompt')]
  .filter(p => p.textContent.includes('*')).length"""
# Error outputs in the notebook model, and tracebacks on screen (stderr rendered anywhere,
# including inside widget Output areas, where panels show exceptions from callbacks).
_ERRORS = f"""() => {{
  const found = [];
  {_NB}.content.widgets.forEach((cell, i) => {{
    if (cell.model.type !== 'code') return;
    for (const o of cell.model.outputs.toJSON()) {{
      if (o.output_type === 'error') found.push(`cell ${{i}}: ${{o.ename}}: ${{o.evalue}}`);
    }}
  }});
  document.querySelectorAll(
    '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]').forEach(el => {{
      if (el.textContent.includes('Traceback'))
        found.push('stderr traceback: ' + el.textContent.slice(0, 400));
  }});
  document.querySelectorAll('.jp-OutputArea-output').forEach(el => {{
    if (el.textContent.includes('Error displaying widget'))
      found.push('widget failed to render: ' + el.textContent.slice(0, 200));
  }});
  // ampnb's panels render an exception from a control as .ampnb-error (or .ampnb-<panel>-error).
  document.querySelectorAll('[class*="ampnb-"]').forEach(el => {{
    if ([...el.classList].some(c => /^ampnb-([a-z0-9]+-)*error$/.test(c)))
      found.push('panel error: ' + el.textContent.slice(0, 400));
  }});
  return found;
}}"""


def open_notebook(page: object, url: str, timeout_s: float = 120) -> None:
    """Open a notebook URL and wait until its kernel is started and idle."""
    page.goto(url)
    page.wait_for_function("() => !!window.jupyterapp", timeout=timeout_s * 1000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout_s * 1000)
    page.wait_for_function(_KERNEL_IDLE, timeout=timeout_s * 1000)


def run_all(page: object, timeout_s: float = 180) -> None:
    """Run every cell (as Run ▸ Run All Cells does) and wait until the kernel is done."""
    # The command's promise settles when every cell ran or execution stopped at an error;
    # a flag on window lets the wait below have a timeout (evaluate itself has none).
    page.evaluate("""() => {
      window.__ampnbRunAll = 'running';
      window.jupyterapp.commands.execute('notebook:run-all-cells').then(
        () => { window.__ampnbRunAll = 'done'; },
        e => { window.__ampnbRunAll = 'failed: ' + e; });
    }""")
    page.wait_for_function(f"""() => window.__ampnbRunAll !== 'running'
        && ({_KERNEL_IDLE})() && ({_BUSY_PROMPTS})() === 0""",
                           timeout=timeout_s * 1000, polling=250)
    state = page.evaluate("() => window.__ampnbRunAll")
    if state != "done":
        raise RuntimeError(f"run all cells did not complete: {state}")
    # Widget views render asynchronously after their output arrives.
    page.wait_for_timeout(500)


def errors(page: object) -> list[str]:
    """Every error the notebook shows: error outputs, tracebacks, widgets that failed."""
    return page.evaluate(_ERRORS)


def wait_for_error(page: object, text: str, timeout_s: float = 20) -> list[str]:
    """Wait until errors() reports one containing text (source code that merely names it
    does not count), and return them all."""
    page.wait_for_function(f"""() => ({_ERRORS})().some(e => e.includes({json.dumps(text)}))""",
                           timeout=timeout_s * 1000, polling=250)
    return errors(page)


def executed_cells(page: object) -> tuple[int, int]:
    """(code cells that ran, code cells) in the open notebook."""
    return tuple(page.evaluate(f"""() => {{
      const code = {_NB}.content.widgets.filter(c => c.model.type === 'code');
      return [code.filter(c => c.model.executionCount !== null).length, code.length];
    }}"""))


def shutdown_kernel(page: object) -> None:
    """Stop the notebook's kernel so that the next notebook has the memory to itself."""
    page.evaluate(f"() => {_NB}.sessionContext.shutdown()")


def write_notebook(path: Path, cells: list[str]) -> Path:
    """A notebook of code cells (markdown where a cell starts with '#md '), kernel python3."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(c[4:]) if c.startswith("#md ")
                else nbformat.v4.new_code_cell(c) for c in cells]
    path.write_text(nbformat.writes(nb), "utf-8")
    return path


def widget_button(scope: object, text: str) -> object:
    """The ipywidgets button labelled exactly `text` inside scope (a page or a locator)."""
    return scope.locator("button.widget-button").filter(
        has_text=re.compile(rf"^\s*{re.escape(text)}\s*$"))
