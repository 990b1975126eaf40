#!/bin/bash
#SBATCH --job-name=megadare-rl-sdar30b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
#
# SDAR-30B-A3B RL with TraceRL on math prompts (math reward; examples/configs/rl_sdar30b.yaml). The Megatron actor
# (TP 2 + sequence parallel, PP 2, EP 8, ETP 1: a multiple of 16 GPUs, default 2 x 8) trains on the first nodes,
# SGLang rollout engines (ENGINE_GPUS=2 GPUs each) run on the last ROLLOUT_NODES nodes; one Ray cluster spans the
# allocation and megadare's rank 0 drives the engines through it.
#
#   sbatch examples/slurm/rl_sdar30b.sh                          # from the repository root
#   MODEL=/ckpt/SDAR-30B-A3B-Chat DATA=/data/math_train.jsonl sbatch -p gpu -A proj examples/slurm/rl_sdar30b.sh
#
# Partition / account / time limit: sbatch -p / -A / -t, or SBATCH_PARTITION / SBATCH_ACCOUNT / SBATCH_TIMELIMIT
# in the environment; node count: sbatch --nodes=N (trainer nodes = N - ROLLOUT_NODES). Every knob below (and the
# shared ones documented in examples/slurm/common.sh) can be set in the environment at submission. When the time
# limit nears (USR1) or the job is preempted (TERM), megadare checkpoints, Ray stops and the job requeues itself;
# the next run resumes from the newest checkpoint under CKPT. The bf16 model is ~61 GB: each SGLang engine spans
# ENGINE_GPUS=2 GPUs (rollout.engine_tp).

: "${MODEL:=/checkpoints/SDAR-30B-A3B-Chat}"  # HF checkpoint directory (config.json, safetensors, tokenizer)
: "${DATA:=/data/math/train.jsonl}"            # RL prompts: `prompt` (or `messages`) + `answer`
: "${EVAL_DATA:=}"                             # held-out prompts (optional)
: "${RUN_DIR:=runs/rl_sdar30b}"                # keep fixed across submissions: requeues resume from here
: "${CKPT:=$RUN_DIR/ckpt}"                     # checkpoint.save root
: "${INIT_CKPT:=}"                             # checkpoint.load (e.g. an SFT checkpoint); empty: MODEL's weights
: "${GPUS_PER_NODE:=${SLURM_GPUS_ON_NODE:-8}}"
: "${ROLLOUT_NODES:=2}"                        # nodes that only run SGLang engines (0: engines share trainer GPUs)
: "${ENGINE_GPUS:=2}"                          # GPUs per engine = its tensor-parallel size
: "${NCCL_DEBUG:=WARN}"
: "${NCCL_IB_HCA:=}"                           # e.g. mlx5_0,mlx5_1 (empty: NCCL's choice)
: "${NCCL_SOCKET_IFNAME:=}"                    # e.g. ib0 or eth0 (empty: NCCL's choice)
: "${EXTRA_OVERRIDES:=}"                       # more key=value overrides, e.g. "rl.steps=50 optim.lr=5e-7"

set -uo pipefail
MEGADARE_ROOT=${MEGADARE_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
[[ -f $MEGADARE_ROOT/examples/slurm/common.sh ]] || {
  echo "megadare: $MEGADARE_ROOT is not the repository: submit from its root or set MEGADARE_ROOT" >&2
  exit 1
}
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$MEGADARE_ROOT/examples/slurm/common.sh"
md_main rl examples/configs/rl_sdar30b.yaml
