"""The one mesh builder on real processes (gloo; run it on 4 as DP=2 x TP=2): torchrun_mesh's mesh and Lightning's
(gpt_tp's ModelParallel.setup_environment) both come from gpt_tp.ranks.build_mesh, and layout_of reads the same sizes,
ranks and groups from each. Every rank writes <out>.<rank>.json."""

import argparse
import json
from unittest import mock

import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from gpt_tp.checkpoint import ModelParallel, lightning_internals
from gpt_tp.entry import run, torchrun_mesh
from gpt_tp.ranks import build_mesh, layout_of


def described(layout) -> dict:
    groups = {dim: dist.get_process_group_ranks(layout.mesh[dim].get_group()) for dim in layout.mesh.mesh_dim_names}
    return {"layout": [layout.dp, layout.tp, layout.dp_rank], "mesh": layout.mesh.mesh.tolist(), "groups": groups,
            "dp_group": dist.get_process_group_ranks(layout.dp_group)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    mesh, _ = torchrun_mesh(2, 2, "cpu")
    res = {"torchrun": described(layout_of(mesh=mesh))}
    trainer = Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=ModelParallel(2, 2), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(BoringModel())
    with mock.patch.object(lightning_internals, "build_mesh", wraps=build_mesh) as built:
        trainer.strategy.setup_environment()  # what Trainer.fit does first
    res["lightning"] = described(layout_of(trainer))
    res["lightning_built"] = [str(c.args[0]) for c in built.call_args_list]
    res["sampler"] = trainer.strategy.distributed_sampler_kwargs
    with open(f"{args.out}.{dist.get_rank()}.json", "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    run(main)
