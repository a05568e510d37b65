"""Lightning (optional: skipped where it is not importable). Fabric's ``fabric.setup(model)`` returns a
``_FabricModule`` holding the sharded model as ``_forward_module``; watched through it, every unit was named
"_forward_module.blocks.0" (a new-user trial, 2 gloo ranks, ``ModelParallelStrategy``), and wrap.params_in_root's
plan, pasted in place of the fully_shard calls in the user's ``parallelize_fn`` (given the model itself), read
``model._forward_module.emb``: AttributeError. The units are named from the model inside the wrapper; the plan
printed for it, pasted there, trains and the rule goes quiet. Fabric launches its ranks by running the script again
(its CPU launcher), as its users run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import TINY_LM, REPO, child_pythonpath

pytest.importorskip("lightning")

_SCRIPT = TINY_LM + textwrap.dedent(
    """
    import json, sys
    import torch, torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy
    import fsdp_doctor

    out, fix = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""

    def parallelize(model, device_mesh):
        if fix:  # in place of the fully_shard calls, as printed
            exec(open(fix).read(), {"model": model})
        else:
            for b in model.blocks:
                fully_shard(b, mesh=device_mesh["data_parallel"])
            fully_shard(model, mesh=device_mesh["data_parallel"])
        return model

    torch.set_num_threads(1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(parallelize, 2, 1))
    fabric.launch()
    fabric.seed_everything(0)
    model = fabric.setup(Net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1 + fabric.global_rank)
    with fsdp_doctor.watch(model, optimizer, out_dir=out, profile=False, capacity_bytes=64 << 20) as doc:
        for _ in range(6):
            x = torch.randint(0, V, (4, 17), generator=g)
            fabric.backward(nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()))
            optimizer.step()
            optimizer.zero_grad()
            doc.step()
    """
)


def _fabric_run(tmp_path, name: str, fix: str = ""):
    import fsdp_doctor

    script = tmp_path / "fabric_case.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(script), str(tmp_path / name), *([fix] if fix else [])], env=env,
                       timeout=300, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return fsdp_doctor.build_report(fsdp_doctor.load_run(tmp_path / name))


@pytest.mark.long
def test_fabric_units_named_as_the_users_model_and_the_plan_pasted_in_parallelize_fn(tmp_path):
    before = _fabric_run(tmp_path, "fabric")
    assert [u.name for u in before.units] == ["", "blocks.0", "blocks.1", "blocks.2"]
    (f,) = [f for f in before.findings if f.code == "wrap.params_in_root"]
    code = f.recommendation.code
    assert "fully_shard(model.emb, mesh=mesh)" in code and "_forward_module" not in code, code

    fix = tmp_path / "fix.py"
    fix.write_text(code)
    after = _fabric_run(tmp_path, "fixed", str(fix))  # (AttributeError '_forward_module' on both ranks before)
    assert {"emb", "head", "blocks.0"} <= {u.name for u in after.units}
    assert not {"wrap.params_in_root", "wrap.root_not_sharded"} & {g.code for g in after.findings}
