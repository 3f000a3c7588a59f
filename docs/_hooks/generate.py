"""MkDocs hooks (``mkdocs.yml``: ``hooks``): the pages generated while the site builds.

* ``reference/configuration.md``: every config field -- binding, type, default, what a resume
  may do with it, meaning -- from the dataclasses' metadata, as ``python -m boost_jax.train
  --print_config`` prints them (``boost_jax.gin_io.describe_fields``). Nothing of it is
  committed, so a field added to the code is on the page at the next build.
* ``<!-- notebook: notebooks/NAME.ipynb cells=2,4 -->`` in a page: the notebook's cells (text,
  code and their committed outputs) put in its place.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[2]
#: pages that exist only in the built site (the docs tests treat links to them as resolved)
GENERATED = ("reference/configuration.md",)
GROUP_INTRO = {
    "Model": "the architecture and its dimensions (`boost_jax/models/config.py`); presets: "
             "[Models](../concepts/models.md)",
    "Parallel": "the mesh and the plans (`boost_jax/parallel/config.py`)",
    "Train": "the run: steps, batch, optimizer, cadences, logging (`boost_jax/config.py`)",
    "Data": "the dataset and the loader (`boost_jax/data/config.py`)",
}
NOTEBOOK = re.compile(r"<!-- notebook: (\S+\.ipynb) cells=([\d,]+) -->")


def _cell(text: str) -> str:
    """A table cell's prose on one line, its ``|`` escaped (a code span's need no escape: the
    tables extension does not split a row inside one)."""
    return text.replace("|", r"\|").replace("\n", " ")


def configuration_page() -> str:
    from boost_jax.gin_io import describe_fields

    rows = describe_fields()
    lines = [
        "# Configuration reference",
        "",
        "Every field of the four config groups, generated from the dataclasses when this site "
        "was built, as `python -m boost_jax.train --print_config` prints them. Set one with "
        "`--gin_param=Group.field=value` or a line of a gin file "
        "([Training](../guides/train.md#configuration-gin-bindings)). *on resume*: what "
        "resuming a checkpoint written with another value does "
        "([Checkpoints and resume](../guides/preemption.md)).",
    ]
    for group, intro in GROUP_INTRO.items():
        lines += ["", f"## {group}", "", f"`{group}`: {intro}.", "",
                  "| binding | type | default | on resume | meaning |", "|---|---|---|---|---|"]
        for binding, kind, default, resume, meaning in rows:
            if binding.split(".")[0] == group:
                lines.append(f"| `{binding}` | `{kind}` | `{default}` | "
                             f"{_cell(resume)} | {_cell(meaning)} |")
    listed = sum(line.startswith("| `") for line in lines)
    assert listed == len(rows), f"{len(rows) - listed} fields of no group {list(GROUP_INTRO)}"
    return "\n".join(lines) + "\n"


def _output(output: dict) -> str:
    if output.get("output_type") == "stream":
        return "```text\n" + "".join(output["text"]).rstrip("\n") + "\n```"
    data = output.get("data", {})
    if "image/png" in data:
        png = "".join(data["image/png"]).replace("\n", "")
        return f'<img alt="notebook output" src="data:image/png;base64,{png}">'
    if "text/html" in data:
        return '<div class="notebook-output">' + "".join(data["text/html"]) + "</div>"
    if "text/plain" in data:
        return "```text\n" + "".join(data["text/plain"]).rstrip("\n") + "\n```"
    return ""


def notebook_cells(path: str, cells: list[int]) -> str:
    notebook = json.loads((REPO / path).read_text())
    parts = []
    for index in cells:
        cell = notebook["cells"][index]
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            parts.append(re.sub(r"^(#+)", r"#\1", source, flags=re.M))  # under the page's ##
        else:
            parts.append("```python\n" + source.rstrip("\n") + "\n```")
            parts += [o for o in map(_output, cell.get("outputs", [])) if o]
    return "\n\n".join(parts)


def on_files(files, config):
    """Add the generated pages."""
    files.append(File.generated(config, "reference/configuration.md",
                                content=configuration_page()))
    return files


def on_page_content(html, page, config, files):
    """The docstrings' reST roles (``:class:`~boost_jax.config.Config```) as plain code."""
    html = re.sub(r":(?:class|mod|func|meth|attr|data|obj|exc):(?=<code>)", "", html)
    return re.sub(r"<code>~(?=[\w.]+</code>)", "<code>", html)


def on_page_markdown(markdown, page, config, files):
    """Put each notebook marker's cells in its place."""
    return NOTEBOOK.sub(
        lambda m: notebook_cells(m[1], [int(c) for c in m[2].split(",")]), markdown)
