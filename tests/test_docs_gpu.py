"""The docs' ```python gpu and ```bash gpu blocks run on a GPU (tests/test_docs.py runs the
others on the host and only compiles these). Each test's id is the file and line of the block's
opening fence."""
from __future__ import annotations

from pathlib import Path

import pytest
from test_docs import Block, block_params, run_block

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("block", [p for p in block_params({"gpu"}) if not p.marks])
def test_doc_gpu_block_runs(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path, timeout=240)
