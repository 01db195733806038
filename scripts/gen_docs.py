"""Write the generated reference pages: docs/config.md (every config key), docs/metrics.md (every metric name),
the README's table of model families (from their adapters) and its record of what ran on a GPU (from the GPU
result files in bench/results: ``bench/gpu_status.py``).

    .venv/bin/python scripts/gen_docs.py            # rewrite both pages
    .venv/bin/python scripts/gen_docs.py --check    # exit 1 naming each page that is stale

The pages come from the code: ``easytrain/config/reference.py`` reads the schema
(``easytrain/config/schema.py``), ``easytrain/trainer/metric_names.py`` holds the metric catalog.
``tests/test_docs_generated.py`` fails while a page differs from what this script writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing it

from bench import gpu_status  # noqa: E402
from easytrain.config import reference  # noqa: E402
from easytrain.models.families import table  # noqa: E402
from easytrain.trainer import metric_names  # noqa: E402

PAGES: dict[str, Callable[[], str]] = {"docs/config.md": reference.markdown, "docs/metrics.md": metric_names.markdown}
"""Page (relative to the repository root) -> what writes its text."""
BLOCKS: dict[str, tuple[Callable[[str], str], ...]] = {"README.md": (table.with_table, gpu_status.with_block)}
"""Page -> what rewrites each of its generated blocks (the rest of the page is written by hand)."""


def rendered(page: str, root: Path = ROOT) -> str:
    if page in PAGES:
        return PAGES[page]()
    text = (root / page).read_text()
    for rewrite in BLOCKS[page]:
        text = rewrite(text)
    return text


def stale(root: Path = ROOT) -> list[str]:
    """The pages whose file differs from what they would be written as now."""
    return [page for page in (*PAGES, *BLOCKS)
            if not (root / page).is_file() or (root / page).read_text() != rendered(page, root)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is stale")
    args = parser.parse_args(argv)
    if args.check:
        old = stale()
        for page in old:
            print(f"{page} is stale: run .venv/bin/python scripts/gen_docs.py", file=sys.stderr)
        return 1 if old else 0
    for page in (*PAGES, *BLOCKS):
        (ROOT / page).write_text(rendered(page))
        print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
