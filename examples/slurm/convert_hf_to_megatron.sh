#!/bin/bash
#SBATCH --job-name=megadare-convert
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --time=04:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
#
# HF safetensors -> Megatron distributed checkpoint (tools/checkpoint_convert/hf_to_megatron.py): one process on one
# node, no GPU, streaming tensor by tensor. The TP/PP/EP sizes are checked against the model (the checkpoint itself
# loads under any layout); pass the result to training as INIT_CKPT. A requeued run converts again (the output is
# written to OUT.tmp and moved into place at the end); a finished OUT is left alone unless FORCE=1.
#
#   MODEL=/ckpt/SDAR-30B-A3B-Chat OUT=/ckpt/sdar30b-mcore TP=2 PP=2 EP=8 sbatch examples/slurm/convert_hf_to_megatron.sh
#
# Partition / account / time limit: sbatch -p / -A / -t, or SBATCH_PARTITION / SBATCH_ACCOUNT / SBATCH_TIMELIMIT.

: "${MODEL:=/checkpoints/SDAR-30B-A3B-Chat}"  # HF checkpoint directory
: "${OUT:=/checkpoints/SDAR-30B-A3B-Chat-mcore}"  # output Megatron checkpoint directory
: "${TP:=2}"                                   # target tensor parallel size (validated)
: "${PP:=2}"                                   # target pipeline parallel size (validated)
: "${EP:=8}"                                   # target expert parallel size (validated)
: "${ETP:=1}"                                  # expert tensor parallel size (empty: TP)
: "${VPP:=}"                                   # virtual pipeline stages (empty: none)
: "${DTYPE:=keep}"                             # keep | fp32 | bf16 | fp16
: "${FORCE:=0}"                                # 1: convert again even if OUT is complete
: "${RUN_DIR:=runs/convert}"                   # job log (slurm/jobs.log)

set -uo pipefail
MEGADARE_ROOT=${MEGADARE_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
[[ -f $MEGADARE_ROOT/examples/slurm/common.sh ]] || {
  echo "megadare: $MEGADARE_ROOT is not the repository: submit from its root or set MEGADARE_ROOT" >&2
  exit 1
}
# shellcheck source-path=SCRIPTDIR source=common.sh
source "$MEGADARE_ROOT/examples/slurm/common.sh"
md_convert
