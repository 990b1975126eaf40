#!/bin/bash
#SBATCH --job-name=megadare-sft-sdar
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
#
# Block-diffusion SFT of SDAR-30B-A3B (examples/configs/sft_sdar.yaml): Megatron TP 2 + sequence parallel, PP 2,
# EP 8, ETP 1, data parallel over the rest (a multiple of 16 GPUs; default 2 x 8). SFT needs no rollout engines,
# so no Ray cluster is started: one torchrun per node. For SDAR-1.7B/4B/8B (dense) set MODEL and
# EXTRA_OVERRIDES="parallel.tp=1 parallel.sp=false parallel.pp=1 parallel.ep=1 parallel.etp=null".
#
#   sbatch examples/slurm/sft_sdar.sh                            # from the repository root
#   MODEL=/ckpt/SDAR-30B-A3B-Chat DATA=/data/sft.jsonl sbatch -p gpu --nodes=8 examples/slurm/sft_sdar.sh
#
# Partition / account / time limit: sbatch -p / -A / -t, or SBATCH_PARTITION / SBATCH_ACCOUNT / SBATCH_TIMELIMIT
# in the environment; node count: sbatch --nodes=N. Every knob below (and the shared ones documented in
# examples/slurm/common.sh) can be set in the environment at submission. When the time limit nears (USR1) or the
# job is preempted (TERM), megadare checkpoints and the job requeues itself; the next run resumes from the newest
# checkpoint under CKPT.

: "${MODEL:=/checkpoints/SDAR-30B-A3B-Chat}"  # HF checkpoint directory (config.json, safetensors, tokenizer)
: "${DATA:=/data/sft/train.jsonl}"             # SFT data: `messages` (or prompt / response) per row
: "${RUN_DIR:=runs/sft_sdar}"                  # keep fixed across submissions: requeues resume from here
: "${CKPT:=$RUN_DIR/ckpt}"                     # checkpoint.save root
: "${INIT_CKPT:=}"                             # checkpoint.load (a Megatron checkpoint); empty: MODEL's weights
: "${GPUS_PER_NODE:=${SLURM_GPUS_ON_NODE:-8}}"
: "${NCCL_DEBUG:=WARN}"
: "${NCCL_IB_HCA:=}"                           # e.g. mlx5_0,mlx5_1 (empty: NCCL's choice)
: "${NCCL_SOCKET_IFNAME:=}"                    # e.g. ib0 or eth0 (empty: NCCL's choice)
: "${EXTRA_OVERRIDES:=}"                       # more key=value overrides, e.g. "train.steps=500 optim.lr=5e-6"

set -uo pipefail
MEGADARE_ROOT=${MEGADARE_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
[[ -f $MEGADARE_ROOT/examples/slurm/common.sh ]] || {
  echo "megadare: $MEGADARE_ROOT is not the repository: submit from its root or set MEGADARE_ROOT" >&2
  exit 1
}
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$MEGADARE_ROOT/examples/slurm/common.sh"
md_main sft examples/configs/sft_sdar.yaml
