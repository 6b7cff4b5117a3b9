#!/bin/bash
# Started by the sbatch scripts in this folder, inside the allocation: one srun task per device running cli.py fit,
# resumed from the newest complete checkpoint, with the preemption and fail-fast callbacks (gpt_tp/cluster/slurm.py).
#   launch.sh CONFIG [extra cli.py arguments]
# Environment (all optional):
#   GPT_TP_CKPT_DIR       where preemption checkpoints go and resuming looks (default checkpoints/slurm-$SLURM_JOB_ID;
#                         a requeued job keeps its id, so it finds its own). It must be on a filesystem every node
#                         sees (NFS, Lustre, GPFS): each rank writes its own shards there.
#   GPT_TP_RESUME_DIRS    more folders to resume from (e.g. a periodic ModelCheckpoint's dirpath, or an earlier job's)
#   GPT_TP_STALL_TIMEOUT  seconds without a finished step before a rank gives up (FailFast; default 900)
#   GPT_TP_PYTHON         the interpreter (default python)
#   GPT_TP_MASTER_ADDR    the rendezvous host (default: the allocation's first node name)
#   GPT_TP_MASTER_PORT    the rendezvous port (default 15000 + job id modulo 16000)
set -euo pipefail
CONFIG=${1:?usage: launch.sh CONFIG [cli.py args]}
shift
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${GPT_TP_PYTHON:-python}
: "${SLURM_JOB_ID:?launch.sh runs inside a Slurm job: sbatch scripts/slurm/train.sbatch CONFIG}"
CKPT_DIR=${GPT_TP_CKPT_DIR:-checkpoints/slurm-$SLURM_JOB_ID}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}  # NCCL: a timed-out collective ends the process

# devices per node and nodes come from the allocation; Lightning's SLURMEnvironment reads the ranks from srun
NTASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE%%(*}}
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
# Rendezvous: set here, so a MASTER_ADDR / MASTER_PORT exported from the submitting shell is not shared by every job.
# The port comes from the job id: jobs whose ids differ by less than 16000 never share one on a node, and it stays
# below Linux's ephemeral ports (32768 and up), so no outgoing connection holds it.
export MASTER_ADDR=${GPT_TP_MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)}
export MASTER_PORT=${GPT_TP_MASTER_PORT:-$((15000 + SLURM_JOB_ID % 16000))}
CKPT=$("$PY" -m gpt_tp.cluster.slurm latest "$CKPT_DIR" ${GPT_TP_RESUME_DIRS:-})
echo "[gpt_tp] job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: $NNODES node(s) x $NTASKS_PER_NODE tasks, config $CONFIG," \
     "checkpoints $CKPT_DIR, resume ${CKPT:-none}, rendezvous $MASTER_ADDR:$MASTER_PORT"

# --kill-on-bad-exit: when one task fails, Slurm ends the others; --wait: and when one exits, the rest within 120 s.
# --cpus-per-task: since Slurm 22.05 srun no longer takes it from sbatch (its release notes); a step would get 1 per task.
# exec: srun is the batch step's process, so on scancel / the time limit it forwards SIGTERM to the tasks and waits
# for their checkpoint instead of a shell dying under it.
# SLURMEnvironment(auto_requeue=false): Lightning's own SIGUSR1 save-and-requeue stays off (gpt_tp.cluster.slurm.Preemption
# saves and requeues; it refuses to run beside Lightning's).
exec srun --kill-on-bad-exit=1 --wait=120 --ntasks-per-node="$NTASKS_PER_NODE" --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
  "$PY" "$REPO/cli.py" fit --config "$CONFIG" \
  --trainer.num_nodes "$NNODES" --trainer.devices "$NTASKS_PER_NODE" \
  --trainer.plugins lightning.pytorch.plugins.environments.SLURMEnvironment --trainer.plugins.auto_requeue false \
  --trainer.callbacks+=gpt_tp.cluster.slurm.Preemption --trainer.callbacks.dirpath "$CKPT_DIR" \
  --trainer.callbacks+=gpt_tp.cluster.slurm.FailFast --trainer.callbacks.stall_timeout_s "${GPT_TP_STALL_TIMEOUT:-900}" \
  ${CKPT:+--ckpt_path "$CKPT"} "$@"
