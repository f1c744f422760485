"""A loop of one's own that uses only ups-samplers and ups-ckpt never imports the engine."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

LOOP = """
import sys
import torch
from torch.utils.data import DataLoader, TensorDataset
from ups.ckpt import checkpointer
from ups.core import RunContext
from ups.samplers import TensorDistributedSampler

ctx = RunContext()
data = TensorDataset(torch.arange(10.0))
sampler = TensorDistributedSampler(data, num_replicas=1, rank=0, seed=0)
for _ in DataLoader(data, batch_size=2, sampler=sampler):
    break
checkpoints = checkpointer(sys.argv[1], ctx=ctx, async_save=True)
checkpoints.save({"sampler": sampler.state_dict()}, step=1, rank_state={})
checkpoints.wait()
assert checkpoints.load_latest().state["sampler"] == sampler.state_dict()
print(sorted(name for name in sys.modules if name.startswith("ups.")))
"""


def test_samplers_and_ckpt_alone_never_import_the_engine(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", LOOP, str(tmp_path)], capture_output=True, text=True, check=True
    )
    imported = set(ast.literal_eval(done.stdout))
    assert {"ups.samplers", "ups.ckpt", "ups.core"} <= imported
    assert imported.isdisjoint(
        {
            "ups.core.engine._run",
            "ups.core.launch._processes",
            "ups.core.plugin._manager",
            "ups.core.engine._update",
        }
    ), imported
