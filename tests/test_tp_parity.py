"""Tensor-parallel runs against the single-device run, on real gloo processes (CPU)."""

import pytest
import torch

from conftest import lightning_fits

TINY_LAYERS = 2


def check_parity(res: dict) -> None:
    # every parameter is a DTensor on one mesh (what clip_grad_norm_ and fused AdamW need), tie kept
    assert res["all_dtensor"] and len(res["meshes"]) == 1
    assert res["tied"]
    # the sharded init gathered is the single-device init, bit for bit
    assert res["init_diff"] == 0.0
    # step 0: loss and every gathered gradient
    assert res["losses"][0] == pytest.approx(res["ref_losses"][0], rel=1e-5)
    worst = max(res["grad_diff"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-5, worst
    assert len(res["grad_diff"]) == 12 * TINY_LAYERS + 4  # every parameter (wte, wpe, ln_f x2, 12 per block; the tied one once)
    assert res["norms"][0] == pytest.approx(res["ref_norms"][0], rel=1e-5)
    # 6 optimizer steps with clipping at 1.0 and fused AdamW: the loss trajectories agree and fall
    assert len(res["losses"]) >= 6
    for a, b in zip(res["losses"], res["ref_losses"]):
        assert a == pytest.approx(b, rel=1e-4)
    assert res["losses"][-1] < res["losses"][0] - 0.1
    # after 6 steps each parameter's distance from the single-device run, over the distance it trained: a broken
    # plan makes it O(1); fp32 reordering, amplified by Adam where gradients nearly cancel, stays near 1e-3
    assert res["final_param_reldiff"] < 1e-2


# The obvious recipe (only Linear/Embedding layers parallelized; wpe, LayerNorms stay plain tensors) crashes where
# gpt_tp runs: the worker applies it beside ours and records the errors: mixed Tensor/DTensor parameters break the
# grad norm and fused AdamW at TP=2, and FSDP2 over it mixes meshes at DP=2 x TP=2.
NAIVE_ERRORS = {
    1: ["aten._foreach_norm.Scalar got mixed torch.Tensor and DTensor", "aten._fused_adamw_.default got mixed torch.Tensor and DTensor"],
    2: ["All operands in aten.stack.default must have the same mesh", None],
}


@pytest.mark.parametrize("dp,nproc", [(1, 2), pytest.param(2, 4, marks=pytest.mark.slow)], ids=["tp2", "dp2xtp2"])
def test_tp_matches_single_device(parity_runs, dp, nproc):
    # conftest's PARITY_LAUNCHES: the quick test of `-m "not slow"` shares its launch with test_muon's
    results = parity_runs("quick", "tp2") if dp == 1 else parity_runs("slow4", "TP_PLAN")
    for res in results:
        check_parity(res)
        assert res["tp_collectives_forward"] == tp_collectives(TINY_LAYERS)["forward"]
        assert res["tp_collectives_backward"] == tp_collectives(TINY_LAYERS)["backward"]
        for expected, got in zip(NAIVE_ERRORS[dp], res["naive_errors"]):
            assert expected is None or (got is not None and expected in got), got
    # every rank reports the same (global) loss and norm
    assert len({tuple(r["losses"]) for r in results}) == 1
    assert len({tuple(r["norms"]) for r in results}) == 1


def tp_collectives(n_layer: int, chunks: int = 1) -> dict[str, dict[str, int]]:
    """Step 0's collectives on the TP group at TP=2: per block an all-gather and a reduce-scatter around attention
    and around the MLP (k of each there with the MLP in k chunks), the embedding's reduce-scatter and lm_head's
    all-gather, the loss's 2 all-reduces; backward the conjugates, and c_attn's, lm_head's and (unchunked) c_fc's
    inputs gathered again for their weight gradients."""
    n = 2 * n_layer + 1 + n_layer * (chunks - 1)
    again = n_layer + 1 + (n_layer if chunks == 1 else 0)
    return {"forward": {"all_gather": n, "reduce_scatter": n, "all_reduce": 2},
            "backward": {"all_gather": n + again, "reduce_scatter": n}}


@pytest.mark.parametrize("plan,chunks,dp,nproc", [
    ("overlap3", 3, 1, 2),  # 64 tokens per rank in 3 chunks of 22, 21, 21
    ("overlap2", 2, 2, 4),
    ("ordered", 1, 1, 2),
    ("dtensor", 1, 1, 2),
    ("torch_recipe", 1, 1, 2),
], ids=["overlap3-tp2", "overlap2-dp2xtp2", "ordered", "dtensor", "torch"])
@pytest.mark.slow
def test_plan_variants_match_single_device(parity_runs, plan, chunks, dp, nproc):
    """The reference plans in benchmarks/plans.py, loaded through --plan module:attribute (the door a user's plan
    takes): the MLP in k chunks with its collectives overlapped, gpt_tp's layout in (B, T) order, torch's DTensor
    styles and its recipe: the same tolerances against the single device as TP_PLAN. The chunked MLP really splits
    its collectives: k all-gathers and k reduce-scatters per MLP each way."""
    results = parity_runs(f"slow{nproc}", plan)  # conftest's PARITY_LAUNCHES: --dp dp --plan benchmarks.plans:<plan>
    for res in results:
        check_parity(res)
        if plan.startswith(("overlap", "ordered")):
            expected = tp_collectives(TINY_LAYERS, chunks)
            assert res["tp_collectives_forward"] == expected["forward"]
            assert res["tp_collectives_backward"] == expected["backward"]
    assert len({tuple(r["losses"]) for r in results}) == 1


@pytest.mark.slow
def test_lightning_tp_runs_match_single_device(lightning_runs):
    """The real training path: Trainer + ModelParallelStrategy, gradient accumulation 2, clip 1.0 through the
    Trainer, fused AdamW, the LR schedule. TP=2; TP=2 built under trainer.init_module(empty_init=True) in
    bf16-mixed; TP=2 with torch.compile per block; DP=2 x TP=2 (FSDP2) built with meta_init, and in bf16-mixed
    (conftest's LIGHTNING_LAUNCHES: 6 steps each)."""
    fits = {**lightning_runs(1)[0], **lightning_runs(2)[0], **lightning_runs(4)[0]}
    ref, ref_w = fits["single"]
    assert ref["fused"] is True
    runs = {
        "tp2": (fits["tp2"], 1e-4),
        "tp2_init_module_bf16": (fits["tp2m"], 1e-3),
        "tp2_compile": (fits["tp2c"], 1e-4),
        "dp2xtp2_meta": (fits["dp2tp2m"], 1e-4),
        # FSDP2 gathers bf16 parameters (MixedPrecisionPolicy) and keeps float32 master weights
        "dp2xtp2_bf16": (fits["dp2tp2b"], 1e-3),
    }
    ref_losses = [r["train/loss"] for r in ref["rows"]]
    assert len(ref_losses) == 6 and ref_losses[-1] < ref_losses[0] - 0.2
    for name, ((res, w), tol) in runs.items():
        assert res["fused"] is True, name
        losses = [r["train/loss"] for r in res["rows"]]
        assert losses == pytest.approx(ref_losses, rel=tol), name
        # the logged grad norm is the global one (a DTensor's local partial would be ~1/sqrt(tp) of it)
        assert res["rows"][0]["train/grad_norm"] == pytest.approx(ref["rows"][0]["train/grad_norm"], rel=max(tol, 1e-4)), name
        assert [r["train/lr"] for r in res["rows"]] == pytest.approx([r["train/lr"] for r in ref["rows"]]), name
        assert all(v.dtype == torch.float32 for v in w["final"].values()), name  # float32 master weights
        for k, v in ref_w["init"].items():  # meta-device init included: same numbers as the single-device init
            assert torch.equal(w["init"][k], v), (name, k)
        worst = max((w["final"][k] - v).abs().max().item() for k, v in ref_w["final"].items())
        # fp32: reordering noise, far below one Adam step (lr 3e-3); bf16 rounding can flip near-zero Adam updates:
        # bounded by 2 x lr per step over 6 steps
        assert worst < (3e-4 if tol == 1e-4 else 2 * 3e-3 * 6), (name, worst)


@pytest.mark.slow
def test_a_callback_reads_true_gradients(lightning_runs):
    """A user's callback in on_before_optimizer_step (before GPTModule's) reads every gradient, gathered, at TP=2
    and DP=2 x TP=2 with gradient accumulation 2, its largest difference over its largest entry against one
    device's, the sequence-parallel LayerNorm and wpe gradients included. Step 0 (the same weights, the same batch):
    within 1e-5. Step 1 follows one fused-AdamW update, which moves every weight by about lr whatever its gradient's
    size, so the fp32 reordering noise of step 0 is in the weights step 1 differentiates: within 1e-4, the
    tolerance of the multi-step parity tests (1.85e-5 was seen on one CPU). grad_norm and
    clip_grad_norm called twice leave the norm and every gradient as they were."""
    # the 2-step runs with the probe (conftest's LIGHTNING_LAUNCHES): single_g, tp2_g, dp2tp2_g
    probes = {name: torch.load(lightning_runs(n)[1] / f"{name}_g.grads.pt") for name, n in (("single", 1), ("tp2", 2), ("dp2tp2", 4))}
    ref = probes.pop("single")
    assert len(ref["grads"]) == 2 and len(ref["grads"][0]) == 12 * TINY_LAYERS + 4
    for name, probe in probes.items():
        for step, (grads, ref_grads) in enumerate(zip(probe["grads"], ref["grads"], strict=True)):
            assert grads.keys() == ref_grads.keys()
            rel = {n: ((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max()).item() for n, g in grads.items()}
            tol = 1e-5 if step == 0 else 1e-4
            worst = max(rel.items(), key=lambda kv: kv[1])
            assert worst[1] < tol, (name, step, worst)
            for n in ("transformer.wpe.weight", "transformer.h.0.ln_1.weight", "transformer.ln_f.bias"):
                assert rel[n] < tol, (name, step, n)
        for pure in probe["pure"] + ref["pure"]:
            assert pure["grads_unchanged"] and len(set(pure["norms"])) == 1, (name, pure)


@pytest.fixture(scope="module")
def step_runs(tmp_path_factory) -> dict:
    """tests/workers/lightning_fit.py with --comms (accumulation 2, the callbacks cli.py adds: Preemption,
    LogWriteCheck, a held CSV logger), 3 steps on one device and at DP=2 x TP=1 (L = 2 blocks), in float32 and
    bf16-mixed: by name, the JSON record."""
    tmp = tmp_path_factory.mktemp("step_runs")
    args = ("--steps", "3", "--comms")
    runs = lightning_fits(tmp, 1, {"one": args, "one_bf16": (*args, "--precision", "bf16-mixed")})
    runs |= lightning_fits(tmp, 2, {"dp2": (*args, "--dp", "2"), "dp2_bf16": (*args, "--dp", "2", "--precision", "bf16-mixed")})
    return {name: res for name, (res, _) in runs.items()}


@pytest.mark.slow
def test_dp_step_reduces_gradients_once_and_syncs_once(step_runs):
    """Each optimizer step of 2 micro-batches at DP=2 x TP=1: FSDP2 gathers its L + 1 units before each forward and
    the L blocks before each backward (2 x (2L + 1)), and reduce-scatters the L + 1 units' gradients once, at the last
    micro-batch (the unsharded gradients fit: Run.sync_once); one all-reduce carries the grad norm, the loss and the
    callbacks' flags, and gpt_tp reads it to the host once. (Lightning 2.6 broadcasts its own SIGTERM flag once a
    micro-batch.) The losses equal one device's within 1e-5, the grad norms within 1e-3."""
    for name, dp in (("one", 1), ("dp2", 2)):
        for step in step_runs[name]["steps"]:
            assert step["host_syncs"] == 1, name
            counts = {k: v for k, v in step["collectives"].items() if not k.endswith("broadcast_")}
            if dp == 1:
                assert counts == {}
            else:
                assert counts == {"data_parallel all_gather": 10, "data_parallel reduce_scatter": 3,
                                  "data_parallel all_reduce": 1}
    for a, b in zip(step_runs["dp2"]["rows"], step_runs["one"]["rows"], strict=True):  # the norm: as in test_ddp.py
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5, abs=0)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-3)


@pytest.mark.slow
def test_bf16_mixed_is_the_same_at_every_layout(step_runs):
    """bf16-mixed keeps the residual stream in bf16 at every layout (GPT.forward rounds each embedding to bf16 as
    FSDP2's bf16 gathers of wte and wpe do at DP > 1): from the same weights, step 0, DP=2 x TP=1 computes one
    device's loss within 1e-6. The later steps differ as FSDP2 takes the gradients in bf16 and rounds the LayerNorm
    weights to bf16, as much as float32 and bf16-mixed differ on one device."""
    one, dp2, f32 = ([r["train/loss"] for r in step_runs[name]["rows"]] for name in ("one_bf16", "dp2_bf16", "one"))
    assert len(one) == len(dp2) == 3
    assert dp2[0] == pytest.approx(one[0], rel=1e-6, abs=0)
    assert dp2 == pytest.approx(one, rel=1e-4) and f32 == pytest.approx(one, rel=1e-4)
