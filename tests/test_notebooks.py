"""The notebooks: stored without outputs, nothing touching CUDA, each showing its multi-GPU command, and each
executed top to bottom in a fresh kernel whose working directory is a temporary folder (nothing is written
into the repository)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def cells(path: Path, kind: str) -> list[str]:
    return [cell.source for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == kind]


def test_the_four_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == [
        "01_quickstart.ipynb", "02_preferences_and_rl.ipynb", "03_hf_roundtrip.ipynb", "04_rwkv_state.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_clean(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.outputs == [] and cell.execution_count is None for cell in code), "clear the outputs"
    assert not any("cuda" in source for source in cells(path, "code"))  # spawn-safe: CUDA starts inside fit
    assert any("astrai-pl fit --config" in s and "--trainer.devices" in s for s in cells(path, "markdown"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_top_to_bottom(path, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, when a cell fails
    assert (tmp_path / "runs").is_dir()  # the runs were written where the kernel ran, not into the repository
    errors = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs
              if out.output_type == "error"]
    assert not errors
