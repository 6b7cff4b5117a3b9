"""Running under Slurm: preemption-safe checkpoints (`Preemption`), failing fast when a rank dies or training stalls
(`FailFast`), the checkpoint to resume from (`latest`): docs/scale.md, "Preemption and requeue", "When a rank dies"."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from gpt_tp.entry import ArgumentParser, run
from gpt_tp.errors import UserError
from gpt_tp.checkpoint.last import checkpoints_line, latest_checkpoint
from gpt_tp.checkpoint.lightning_internals import save_step

PREFIX = "gpt_tp"
STOPS = (signal.SIGTERM, signal.SIGINT)  # save the step reached, then exit 128 + the signal (the shell's "ended by")
COLLECTIVE_FAILURES = (  # what an error says when another rank died or hung (gloo, NCCL, c10d timeouts)
    "Connection closed by peer", "Connection reset by peer", "Timed out waiting", "DistBackendError", "NCCL error",
    "ncclRemoteError", "Broken pipe", "Watchdog caught collective operation timeout", "DistNetworkError",
    "recv operation", "send operation")
SLURM_ENV_FLAGS = "--trainer.plugins lightning.pytorch.plugins.environments.SLURMEnvironment --trainer.plugins.auto_requeue false"


class PreemptionError(UserError):
    """Preemption configured beside Lightning's own SIGUSR1 save-and-requeue."""


def _say(msg: str) -> None:
    print(f"[{PREFIX}] {msg}", file=sys.stderr, flush=True)


class Preemption(Callback):
    """At the next optimizer step after SIGTERM, SIGINT (Ctrl-C; again: no change) or signal_name, save a checkpoint
    (all ranks together), then leave: after SIGTERM or SIGINT exit 128 + its number, after signal_name requeue the Slurm
    job and exit 0. cli.py adds one to every run that lists none (dirpath None, signal_name None): Lightning's own
    SIGTERM handler runs a collective inside the handler, which hangs when not every rank got the signal.

    Args:
        dirpath: folder for `preempt-step=N.ckpt`; give it to `python -m gpt_tp.cluster.slurm latest` when resuming.
            None: the trainer's ModelCheckpoint callbacks save the step, and last.ckpt names it.
        signal_name: the signal Slurm sends before the end (`#SBATCH --signal=USR1@90`); not SIGTERM. None: SIGTERM
            only.
        requeue: run `scontrol requeue $SLURM_JOB_ID` on rank 0 after a save for signal_name (only inside a Slurm job).
    """

    def __init__(self, dirpath: str | None = "checkpoints", signal_name: str | None = "SIGUSR1", requeue: bool = True):
        try:
            self.signum = None if signal_name is None else signal.Signals[signal_name]
        except KeyError:
            raise ValueError(f"signal_name={signal_name!r} is not a signal name; use e.g. SIGUSR1") from None
        if self.signum == signal.SIGTERM:
            raise ValueError("signal_name='SIGTERM': SIGTERM always saves and exits without requeue; use SIGUSR1 (#SBATCH --signal=USR1@90)")
        self.dirpath, self.requeue = dirpath, requeue
        self.requested, self.terminated = False, 0  # signal_name arrived; the stop signal that arrived (0: none)
        self._previous: dict = {}  # signal -> the handler ours replaced
        self._last_step, self._sums = None, None  # sums: every rank's step_flags, summed
        self._leave_after: str | None = None  # once saved: the stop signal's name, or the Slurm job to requeue

    def _on_signal(self, signum, frame) -> None:  # only a flag: no I/O, no collectives inside a signal handler
        if signum in STOPS:
            self.terminated = max(self.terminated, signum)  # SIGTERM's name wins over SIGINT's
        else:
            self.requested = True

    def _install(self, signum) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.signum is None:
            return
        env = getattr(trainer.strategy, "cluster_environment", None)
        if isinstance(env, SLURMEnvironment) and env.auto_requeue:
            raise PreemptionError("gpt_tp.cluster.slurm.Preemption saves and requeues the job itself, but Lightning's "
                                  "SLURMEnvironment has auto_requeue on (its default inside a Slurm job): pass "
                                  f"{SLURM_ENV_FLAGS} (scripts/slurm/launch.sh does)")
        self._install(self.signum)

    def on_train_start(self, trainer, pl_module) -> None:
        for signum in STOPS:  # replaces Lightning's SIGTERM handler (installed just before training) and KeyboardInterrupt
            self._install(signum)
        if self.signum is None:
            return
        keys = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "MASTER_ADDR", "MASTER_PORT")
        env = " ".join(f"{k}={os.environ.get(k, '-')}" for k in keys)
        _say(f"rank {trainer.global_rank} of {trainer.world_size}: {env} host={socket.gethostname()} "
             f"restart={os.environ.get('SLURM_RESTART_COUNT', 0)}")

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:  # Lightning may have restored its snapshot already
                signal.signal(signum, previous)
        self._previous = {}

    def step_flags(self, trainer) -> list[float]:
        return [self.requested, *(self.terminated == s for s in STOPS)]

    def flags_summed(self, trainer, sums: list[float]) -> None:
        self._sums = sums  # every rank's, summed in GPTModule's step (on_before_optimizer_step), which Preemption needs

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._last_step:  # inside gradient accumulation: not a step boundary
            return
        self._last_step, sums, self._sums = trainer.global_step, self._sums or [0] * 3, None
        requested, terminated = sums[0] > 0, next((s for s, n in zip(STOPS, sums[1:]) if n > 0), 0)  # SIGTERM's first
        if not (requested or terminated):
            return
        name, step = signal.Signals(terminated).name if terminated else self.signum.name, trainer.global_step
        if self.dirpath is None:  # the run's own checkpoints: last.ckpt names the step
            saved = [p for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)
                     if (p := save_step(cb, trainer))]
            getattr(trainer.strategy, "finish_save", lambda: None)()  # an asynchronous save: committed before leaving
            where = (f"saved {checkpoints_line(trainer)}; resume with --ckpt_path last" if saved
                     else "nothing saved (trainer.callbacks has no ModelCheckpoint)")
        else:
            path = os.path.join(self.dirpath, f"preempt-step={step}.ckpt")
            rank_zero_info(f"[{PREFIX}] preemption signal ({name}): saving {path} at step {step}")
            trainer.save_checkpoint(path)
            getattr(trainer.strategy, "finish_save", lambda: None)()
            where = f"saved {path}; resume with --ckpt_path {path}"
        trainer.strategy.barrier("gpt_tp_preemption_saved")
        job = os.environ.get("SLURM_ARRAY_JOB_ID")
        job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job else os.environ.get("SLURM_JOB_ID")
        if terminated:
            if trainer.is_global_zero:  # the run's closing line (cli.py's after_fit does not run)
                print(f"gpt_tp fit: stopped by {name} at step {step}; {where}", flush=True)
            self._leave_after = name  # the job is ending: no requeue
        elif self.requeue and job:
            self._leave_after = job
        else:
            trainer.should_stop = True  # a clean stop; whoever sent the signal restarts the run

    def _leave(self, trainer, *_) -> None:
        """Leave once Lightning has logged the saved step: at the next batch start, validation start or train end."""
        if self._leave_after is None:
            return
        for logger in trainer.loggers:  # the metrics up to the checkpoint reach disk before the job goes
            logger.save()
        if self._leave_after in (s.name for s in STOPS):
            _exit_now(f"rank {trainer.global_rank}: checkpoint saved after {self._leave_after}: exiting",
                      128 + signal.Signals[self._leave_after])
        job, self._leave_after = self._leave_after, None
        ok = True
        if trainer.is_global_zero:
            ok = (rc := subprocess.call(["scontrol", "requeue", job])) == 0
            _say(f"scontrol requeue {job} -> {'ok' if ok else f'failed with exit code {rc}; stopping without requeue'}")
        if trainer.strategy.reduce_boolean_decision(ok, all=True):  # Slurm is about to SIGTERM every task
            _exit_now(f"rank {trainer.global_rank}: checkpoint saved, job requeued: exiting", 0)
        trainer.should_stop = True

    on_train_batch_start = on_validation_start = on_train_end = _leave


def _exit_now(message: str, code: int) -> None:
    """Say `message` and leave now, without the end-of-training hooks (more checkpoints, collectives): after a save
    they would run into Slurm's SIGKILL (KillWait seconds after its SIGTERM), after a peer died wait on it."""
    _say(message)
    sys.stdout.flush()
    os._exit(code)


class FailFast(Callback):
    """End this rank promptly and clearly when a peer rank dies or training stalls. cli.py adds one without the
    watchdog to every run that lists none.

    Args:
        stall_timeout_s: exit when no optimizer step or validation batch finishes for this long (cover the slowest
            legitimate gap: a validation run, a checkpoint save); None disables the watchdog.
        first_step_timeout_s: the allowance for the first step (torch.compile, NCCL setup).
        exit_code: the process exit code for both cases (srun then ends the other tasks).
        report_every_n_steps: rank 0 prints "[gpt_tp] rank 0: step N" this often (a heartbeat in batch logs).
    """

    def __init__(self, stall_timeout_s: float | None = 600.0, first_step_timeout_s: float = 1800.0, exit_code: int = 75,
                 report_every_n_steps: int | None = None):
        if stall_timeout_s is not None and stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s={stall_timeout_s} must be > 0 (or null to disable the watchdog)")
        self.stall_timeout_s, self.first_step_timeout_s = stall_timeout_s, first_step_timeout_s
        self.exit_code, self.report_every_n_steps = exit_code, report_every_n_steps
        self._beat, self._started, self._rank, self._step = time.monotonic(), False, 0, 0
        self._stop, self._thread = threading.Event(), None

    def _heartbeat(self, trainer, *_) -> None:
        self._beat, self._started, self._step = time.monotonic(), True, trainer.global_step

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            limit = self.stall_timeout_s if self._started else max(self.stall_timeout_s, self.first_step_timeout_s)
            idle = time.monotonic() - self._beat
            if idle > limit:
                _say(f"rank {self._rank}: no training progress for {idle:.0f} s (limit {limit:g} s, last step "
                     f"{self._step}); another rank probably died or hangs in a collective. Exiting with code "
                     f"{self.exit_code}; see the other ranks' logs, then resume from the latest checkpoint.")
                os._exit(self.exit_code)

    def on_train_start(self, trainer, pl_module) -> None:
        self._rank, self._beat = trainer.global_rank, time.monotonic()
        if self.stall_timeout_s is not None and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="gpt_tp-failfast", daemon=True)
            self._thread.start()
            _say(f"rank {self._rank}: fail-fast watchdog on (stall timeout {self.stall_timeout_s} s)")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, n = trainer.global_step, self.report_every_n_steps
        if n and trainer.is_global_zero and step != self._step and step % n == 0:
            _say(f"rank 0: step {step}")
        self._heartbeat(trainer)

    on_validation_batch_end = on_save_checkpoint = _heartbeat

    def on_train_end(self, *_) -> None:  # on_exception too: the watchdog stops
        self._stop.set()
        self._thread = None

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.on_train_end()
        if not isinstance(exception, UserError) and any(k in f"{type(exception).__name__}: {exception}" for k in COLLECTIVE_FAILURES):
            first = str(exception).strip().splitlines()[0][:300]
            # the ranks this process started (Lightning's launcher) that ended, given 2 s for the kernel to report the
            # one whose closed connection failed the collective: `rank 1 died (killed by SIGKILL)`
            procs, end = getattr(trainer.strategy.launcher, "procs", None) or [], time.monotonic() + 2
            while procs and all(p.poll() is None for p in procs) and time.monotonic() < end:
                time.sleep(0.05)
            dead = "; ".join(f"rank {r} died ({f'killed by {signal.Signals(-c).name}' if c < 0 else f'exit code {c}'})"
                             for r, p in enumerate(procs, trainer.global_rank + 1) if (c := p.poll()) is not None)
            _exit_now(f"rank {trainer.global_rank}: a collective failed at step {trainer.global_step}: "
                      f"{dead or 'another rank died or hung'} ({type(exception).__name__}: {first}). Exiting with code "
                      f"{self.exit_code}; see the other ranks' logs, then resume from the latest checkpoint.", self.exit_code)


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser("python -m gpt_tp.cluster.slurm", "Cluster helpers for gpt_tp.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    lat = sub.add_parser("latest", help="print the newest complete checkpoint in the folders (nothing if none)")
    lat.add_argument("dirs", nargs="+")
    args = ap.parse_args(argv)  # "latest", the one subcommand
    if path := latest_checkpoint(*args.dirs):
        print(path)
    else:  # stdout stays empty (the sbatch scripts start from step 0); stderr says why, a typo included
        missing = [d for d in args.dirs if not os.path.isdir(d)]
        print(f"gpt_tp: no complete checkpoint in {' '.join(args.dirs)}"
              + (f" ({', '.join(missing)}: no such folder)" if missing else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    run(main)
