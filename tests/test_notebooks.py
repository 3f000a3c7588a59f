"""The notebooks: committed executed (nbformat 4.5, cell ids, small outputs without local paths),
and they run top to bottom in a real Jupyter kernel (nbclient + ipykernel, the ``test`` extra).

After editing a notebook, re-execute it in place with this file (a fresh kernel in a temporary
working directory, the test's environment, local paths in the outputs made relative)::

    python tests/test_notebooks.py notebooks/quickstart.ipynb
"""

import json
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

try:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError
except ImportError as err:  # a failure, not a skip: CI installs the test extra
    raise ImportError(f"the notebook tests need nbclient and ipykernel ({err}): "
                      "pip install -e '.[test]'") from err

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
MAX_BYTES = 200_000  # outputs stay small: no big arrays, no progress spam
DEVICES = "--xla_force_host_platform_device_count=8"


def kernel_env(workdir: Path) -> dict[str, str]:
    """The kernel's environment (it is a subprocess): 8 CPU devices, a fresh corpus cache in
    ``workdir``, this checkout's package; matplotlib keeps the kernel's (headless) inline
    backend, so figures are outputs as for a user."""
    env = dict(os.environ, BOOST_JAX_CACHE=str(workdir / "cache"),
               IPYTHONDIR=str(workdir / "ipython"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("MPLBACKEND", None)
    env.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {DEVICES}".strip()
    return env


def execute(nb, workdir: Path):
    """Run ``nb`` top to bottom in a fresh ``python3`` kernel working in ``workdir``; fails the
    test on a cell error, or with a clear message when the kernel does not start."""
    started = []
    client = NotebookClient(nb, timeout=300, startup_timeout=120, kernel_name="python3",
                            record_timing=False, resources={"metadata": {"path": str(workdir)}},
                            on_notebook_start=lambda notebook: started.append(True))
    try:
        return client.execute(env=kernel_env(workdir))
    except CellExecutionError as err:
        pytest.fail("a cell failed\n" + re.sub(r"\x1b\[[0-9;]*m", "", str(err)), pytrace=False)
    except Exception as err:
        if started:
            raise
        pytest.fail(f"could not start the Jupyter kernel 'python3': {type(err).__name__}: {err}"
                    "\nThe notebook tests need nbclient and ipykernel: pip install -e '.[test]'",
                    pytrace=False)


def _output_text(cells) -> str:
    """Every output's text (streams, errors, non-image data), for the local-path check."""
    parts = []
    for cell in cells:
        for out in cell.get("outputs", []):
            parts.append("".join(out.get("text", "")) + "".join(out.get("traceback", [])))
            parts += ["".join(v) for k, v in out.get("data", {}).items()
                      if not k.startswith("image/")]
    return "\n".join(parts)


def test_notebooks_found():
    assert {"quickstart.ipynb", "shard_layouts.ipynb"} <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_committed_executed(path):
    text = path.read_text()
    assert len(text.encode()) < MAX_BYTES, f"{path.name}: outputs too large"
    raw = json.loads(text)
    assert (raw["nbformat"], raw["nbformat_minor"]) >= (4, 5), "cell ids need nbformat >= 4.5"
    assert raw["metadata"]["kernelspec"]["name"] == "python3"
    ids = [cell.get("id") for cell in raw["cells"]]
    assert all(ids) and len(set(ids)) == len(ids), "every cell needs a unique id"
    nbformat.validate(nbformat.reads(text, as_version=4))
    code = [cell for cell in raw["cells"] if cell["cell_type"] == "code"]
    assert [cell["execution_count"] for cell in code] == list(range(1, len(code) + 1)), \
        "commit the notebook executed top to bottom in a fresh kernel (see the module docstring)"
    assert any(cell["outputs"] for cell in code), "commit the notebook with its outputs"
    assert all(o["output_type"] != "error" for cell in code for o in cell["outputs"])
    outputs = _output_text(code)
    for local in {str(REPO), str(Path.home()), tempfile.gettempdir()}:
        assert local not in outputs, f"{path.name}: a local path ({local}) in the outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path):
    execute(nbformat.read(path, as_version=4), tmp_path)


def rewrite(path: Path) -> None:
    """Execute ``path`` in place, with cell ids, its outputs kept but without local paths
    (the temporary corpus cache reads as the default one) and adjacent streams merged."""
    _, nb = nbformat.validator.normalize(nbformat.read(path, as_version=4))  # adds cell ids
    nb = nbformat.from_dict(nb)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp).resolve()
        execute(nb, workdir)
    for cell in nb.cells:
        merged = []
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                out.text = (out.text.replace(f"{workdir / 'cache'}", "~/.cache/boost_jax")
                            .replace(f"{workdir}{os.sep}", ""))
                if merged and merged[-1].output_type == "stream" and merged[-1].name == out.name:
                    merged[-1].text += out.text
                    continue
            merged.append(out)
        if cell.cell_type == "code":
            cell.outputs = merged
    nbformat.validate(nb)
    nbformat.write(nb, path)


if __name__ == "__main__":
    for arg in sys.argv[1:] or NOTEBOOKS:
        rewrite(Path(arg))
        print(f"executed {arg}")
