"""Stress the end of a run: repeat the 2-process TP=2 Lightning fit job of tests/test_tp_parity.py and count
non-zero exits and aborts ("terminate called ...", SIGABRT, glibc's "malloc(): ..." heap checks). A benchmark, not a
CI test. With --resume: a 4-step one-device run of tests/workers/ckpt_fit.py saves a checkpoint, and each run resumes
it at TP=2 with gradient accumulation 2 (tests/test_checkpoint.py's resume at another layout). --malloc-check runs
every job under glibc's heap checks (MALLOC_CHECK_=3, glibc's debug malloc preloaded where glibc has one).
--heap-split lists gpt_tp.train.malloc.HeapSplit in the resumed runs (configs/cpu.yaml lists it).

    python tests/tools/stress_exit.py --runs 30            # about 25 s a run on 2 CPU cores
    python tests/tools/stress_exit.py --runs 50 --resume --malloc-check
"""

import collections
import ctypes.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from gpt_tp.entry import ArgumentParser, run  # noqa: E402 (the checkout's package, run as a script)

JOB = ["tests/workers/lightning_fit.py", "--tp", "2", "--init-module", "--precision", "bf16-mixed"]


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser("python tests/tools/stress_exit.py", __doc__)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--root", default=str(ROOT), help="the checkout whose worker to run (default: this one)")
    ap.add_argument("--keep", default=None, help="write each failed run's full output to this folder")
    ap.add_argument("--resume", action="store_true", help="the job: a one-device checkpoint resumed at TP=2, accumulation 2")
    ap.add_argument("--heap-split", action="store_true", help="with --resume: the resumed runs list HeapSplit")
    ap.add_argument("--malloc-check", action="store_true", help="MALLOC_CHECK_=3 with glibc's debug malloc")
    args = ap.parse_args(argv)
    # faulthandler: an abort prints every Python thread's stack, showing where the process was
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": args.root, "PYTHONFAULTHANDLER": "1"}
    counts, times = collections.Counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        job = JOB
        if args.resume:
            subprocess.run([sys.executable, "tests/workers/ckpt_fit.py", "--steps", "4", "--ckpt-dir", f"{tmp}/one",
                            "--out", f"{tmp}/one"], cwd=args.root, env=env, capture_output=True, check=True)
            job = ["tests/workers/ckpt_fit.py", "--tp", "2", "--accum", "2", "--steps", "6", "--resume",
                   os.path.realpath(f"{tmp}/one/last.ckpt")] + (["--heap-split"] if args.heap_split else [])
        if args.malloc_check:
            debug = ctypes.util.find_library("c_malloc_debug")  # glibc >= 2.34 reads MALLOC_CHECK_ only with it loaded
            env |= {"MALLOC_CHECK_": "3", **({"LD_PRELOAD": debug} if debug else {})}
        for i in range(args.runs):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *job, "--out", f"{tmp}/r{i}"]
            if args.resume:
                cmd += ["--ckpt-dir", f"{tmp}/ckpt{i}"]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, cwd=args.root, env=env, capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            out = p.stdout + p.stderr
            kind = "ok" if p.returncode == 0 else "failed"
            if any(s in out for s in ("terminate called", "SIGABRT", "Signal 6", "malloc(): ", "free(): ", "tcache")):
                kind = "abort"
            counts[kind] += 1
            print(f"run {i + 1}/{args.runs}: rc={p.returncode} {kind} {times[-1]:.1f}s", flush=True)
            if kind != "ok":
                print("\n".join(out.splitlines()[-15:]), flush=True)
                if args.keep:
                    Path(args.keep).mkdir(parents=True, exist_ok=True)
                    Path(args.keep, f"run{i + 1}.log").write_text(out)
    times.sort()
    print(f"{args.runs} runs: {counts['ok']} ok, {counts['failed']} non-zero exits, {counts['abort']} aborts at exit; "
          f"time per run min/median/max {times[0]:.1f}/{times[len(times) // 2]:.1f}/{times[-1]:.1f} s")
    return 0 if counts["ok"] == args.runs else 1


if __name__ == "__main__":
    run(main)
