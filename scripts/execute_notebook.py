"""Execute examples/notebook.ipynb in place, as a user would run it, and keep its outputs small.

The notebook is committed executed (a reader on GitHub sees the table, the plot and a sample).
Rerun after changing it or the numerics: ``python scripts/execute_notebook.py``. The ranks'
progress bars are dropped; of their logs only the strategy's own lines are kept.
"""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

ex = Path(__file__).resolve().parent.parent / "examples"
nb = nbformat.read(ex / "notebook.ipynb", as_version=4)
NotebookClient(
    nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ex)}}
).execute()
for c in nb.cells:
    if c.cell_type != "code":
        continue
    kept = []
    for o in c.outputs:
        if o.get("output_type") == "stream":
            # the ranks' progress bars (carriage-return redraws) and logs are noise in a file
            text = "".join(
                line
                for line in o["text"].splitlines(True)
                if "\r" not in line and "it/s" not in line and "\x1b" not in line
            )
            if o.get("name") == "stderr":
                text = "".join(
                    line
                    for line in text.splitlines(True)
                    if "OneBit" in line or "compression" in line
                )
            if text.strip():
                o["text"] = text
                kept.append(o)
        elif o.get("output_type") == "display_data" and "image/png" not in o.get("data", {}):
            continue  # progress-bar widgets
        else:
            kept.append(o)
    merged = []  # consecutive writes to one stream as one output
    for o in kept:
        if (
            merged
            and o.get("output_type") == "stream"
            and merged[-1].get("output_type") == "stream"
            and merged[-1]["name"] == o["name"]
        ):
            merged[-1]["text"] += o["text"]
        else:
            merged.append(o)
    c.outputs = merged
    c.metadata.pop("execution", None)
nbformat.write(nb, ex / "notebook.ipynb")
print(sum(len(c.outputs) for c in nb.cells if c.cell_type == "code"), "outputs")
