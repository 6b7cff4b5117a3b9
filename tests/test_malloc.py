"""HeapSplit (gpt_tp.train.malloc): where a CPU run's buffers live, read from /proc/self/maps in a fresh process."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

# glibc and /proc; a fresh interpreter's heap (a process forked from tests/tools/zygote.py's inherits the server's)
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc"),
              pytest.mark.real_interpreter]


def where(policy: str, *mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "workers")])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "workers" / "malloc_fit.py"), policy, *mode],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_split_keeps_the_run_long_state_out_of_the_heap():
    """split: the weights and AdamW state of 128 KiB and more have mappings of their own (glibc may still serve a
    request from a freed heap chunk that fits it: at most 1 of the 27 tensors), the gradients too, each keeping its
    buffer from step to step (across a validation, before which Lightning frees them), and once the first optimizer
    step has returned, per-step buffers come from the heap (before it, a 1 MiB buffer had its own mapping too, the
    sanity validation's included)."""
    r = where("split")
    assert r["n_state"] == 27  # (wte + 4 matrices x 2 blocks) x (weight, exp_avg, exp_avg_sq)
    assert r["state_in_heap"] < 0.1
    assert r["grads_in_heap"] == [0.0] * 4 and r["grads_kept"]
    assert not r["before_first_step"] and r["after_first_step"]
    assert not r["in_validation"]  # the sanity check, before the first step


@pytest.mark.slow
def test_mallopt_is_called_when_built_and_once_in_the_fit():
    """HeapSplit calls mallopt (which glibc documents as unsafe while other threads allocate) when it is built, before
    the fit starts its process group, and split once more, after the first optimizer step; never in any other step."""
    assert where("split", "calls") == {"mallopt": ["built", "fit"]}
    assert where("mmap", "calls") == {"mallopt": ["built"]}


@pytest.mark.slow
def test_split_validate_run_uses_the_heap_once_it_starts():
    """A validate run has no optimizer step: its weights, loaded, are the run-long state, and its batches' buffers
    come from the heap."""
    assert where("split", "validate") == {"in_validation": True}


@pytest.mark.slow
def test_split_returns_the_heaps_free_pages_before_the_loss():
    """split: buffers freed in the heap below one still in use stay resident under glibc (the control below); before
    the loss, a step's high point, the training step gives the heap's free pages back (malloc_trim), so a further
    trim at the loss finds nothing left to return."""
    r = where("split", "trim")
    assert r["in_heap"]
    assert r["further_trim"] < 2 * 2**20


@pytest.mark.slow
def test_glibc_keeps_freed_heap_pages_resident():
    """The control: without the callback (glibc's defaults) the same 24 MiB of freed buffers are still resident at the loss."""
    r = where("glibc", "trim")
    assert r["in_heap"]
    assert r["further_trim"] >= 20 * 2**20


@pytest.mark.slow
def test_glibc_defaults_mix_run_long_state_into_the_heap():
    """Without the callback, glibc's own rising threshold puts most of the same state in the heap, among the per-step
    buffers, and a new gradient buffer is allocated every step: the layout split avoids."""
    r = where("glibc")
    assert r["state_in_heap"] > 0.5 and min(r["grads_in_heap"]) > 0.5
    assert not r["grads_kept"]


@pytest.mark.slow
def test_mmap_maps_every_buffer_for_the_whole_run():
    r = where("mmap")
    assert r["state_in_heap"] < 0.1 and r["grads_in_heap"] == [0.0] * 4
    assert not r["before_first_step"] and not r["after_first_step"]
