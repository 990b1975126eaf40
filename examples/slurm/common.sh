#!/bin/bash
# shellcheck shell=bash
#
# examples/slurm/common.sh: the one implementation behind megadare's Slurm launch scripts.
#
# The launch scripts (rl_*.sh, sft_sdar.sh, convert_hf_to_megatron.sh) set their knobs, source this file and call
#   md_main rl|sft CONFIG   Ray cluster over the allocation (rl only), `torchrun -m megadare rl|sft --config CONFIG
#                           key=value...` on the trainer nodes, then teardown (and requeue on preemption)
#   md_convert              tools/checkpoint_convert/hf_to_megatron.py on one node
# srun runs this file on every node as the per-node wrapper of the trainer:
#   bash common.sh node-torchrun TRAINER_HOSTS TORCHRUN_ARGS...   node_rank = this host's place in TRAINER_HOSTS
#   bash common.sh node-run CMD...                                one plain command
# The wrapper starts its command with SIGUSR2 ignored and turns a SIGUSR2 (forwarded by srun on a stop request)
# or SIGTERM into a SIGTERM to the training ranks (torchrun's children): megadare then finishes the step, writes
# a checkpoint and exits 0. (A SIGTERM sent to srun itself would SIGKILL the step: srun never forwards TERM.)
#
# Shared knobs (environment variables; every one has a default):
#   MEGADARE_ROOT       repository checkout (default: $SLURM_SUBMIT_DIR: submit from the repository root)
#   VENV                a virtualenv to activate first (default: none, use the environment sbatch exported)
#   PYTHON              python with megadare installed (default: python)
#   RUN_DIR             run directory (logs, config.yaml); relative paths are under MEGADARE_ROOT. Keep it fixed
#                       between submissions: a requeued or resubmitted job resumes from the newest checkpoint
#   CKPT                checkpoint.save root (default: $RUN_DIR/ckpt); megadare resumes from its newest checkpoint
#   INIT_CKPT           checkpoint.load: initial weights (a Megatron checkpoint), empty = the HF weights of MODEL
#   LOG_DIR             Ray logs (appended: a requeue keeps the dead attempt's) and the resolved config (default:
#                       $RUN_DIR/slurm)
#   GPUS_PER_NODE       (default: $SLURM_GPUS_ON_NODE, else 8)
#   CPUS_PER_NODE       --cpus-per-task of every job step (default: $SLURM_CPUS_ON_NODE)
#   ROLLOUT_NODES       rl: the last ROLLOUT_NODES nodes run only SGLang engines (Ray advertises no GPUs on the
#                       trainer nodes); 0 = engines share the trainer's GPUs
#   ENGINE_GPUS         rl: GPUs per rollout engine = its tensor-parallel size (rollout.engine_resources num_gpus,
#                       rollout.engine_tp; default 1)
#   NUM_ENGINES         rl: rollout.num_engines (default: the rollout GPUs / ENGINE_GPUS)
#   ENGINE_CPUS         rl: CPUs per engine actor (rollout.engine_resources num_cpus; default: the config's)
#   HEAD_IP             Ray head and torch master address (default: `hostname --ip-address` on the first node)
#   RAY_PORT (6379)  MASTER_PORT (29500): pick them outside Ray's random ports (10002-19999 and the kernel's
#                       ephemeral range); a MASTER_PORT taken when the trainer starts ends the job in one line
#   RAY_WAIT_TIMEOUT_S  seconds to wait for every node to join Ray (default 300)
#   RAY_POLL_S          seconds between `ray status` polls (default 5)
#   RAY_STOP_S          seconds each node's Ray gets to shut down at the end before its step is killed (default 60)
#   RAY_AUTH_MODE       Ray token authentication (default: token, with a fresh RAY_AUTH_TOKEN per run unless
#                       RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH is set; `disabled` turns it off)
#   STOP_GRACE_S        seconds the trainer gets to checkpoint after SIGTERM before its step is killed (default
#                       240, inside the 300 s of `#SBATCH --signal=B:USR1@300`)
#   REQUEUE_ON_TERM     1: SIGTERM to the batch script (preemption) requeues like USR1 does (default 1);
#                       SIGINT never requeues (`scancel --batch --signal=INT JOBID` ends a run for good)
#   MAX_REQUEUES        no requeue once $SLURM_RESTART_COUNT reaches it (default 100)
#   PREFLIGHT           1: `megadare rl|sft --dry-run` with the trainer's overrides before anything starts (config,
#                       memory plan, model, tokenizer, data rows, reward, engine, run directory); config: the config
#                       and memory plan only (--config-only); 0: none
#   EXTRA_OVERRIDES     more key=value config overrides, whitespace-separated (e.g. "rl.steps=50 optim.lr=5e-7")
#   NCCL_DEBUG, NCCL_IB_HCA, NCCL_SOCKET_IFNAME, ...   exported when non-empty (GLOO_SOCKET_IFNAME follows
#                       NCCL_SOCKET_IFNAME unless set)

MD_COMMON="${BASH_SOURCE[0]}"
MD_REQUEUE=0
MD_STOPPING=0
MD_STOP_DEADLINE=
MD_TRAINER_PID=
MD_RAY_PIDS=()
MD_HOSTS=()
MD_OVERRIDES=()

md_log() { printf '[megadare-slurm %(%F %T)T] %s\n' -1 "$*" >&2; }

md_die() {
  md_log "error: $*"
  exit 1
}

md_abs() {  # md_abs PATH: PATH, made absolute against MEGADARE_ROOT
  if [[ -z $1 || $1 == /* ]]; then printf '%s' "$1"; else printf '%s/%s' "$MEGADARE_ROOT" "$1"; fi
}

md_defaults() {
  : "${PYTHON:=python}"
  RUN_DIR=$(md_abs "${RUN_DIR:-runs/${MD_NAME:-megadare}}")
  CKPT=$(md_abs "${CKPT:-$RUN_DIR/ckpt}")
  LOG_DIR=$(md_abs "${LOG_DIR:-$RUN_DIR/slurm}")
  MODEL=$(md_abs "${MODEL:-}")
  DATA=$(md_abs "${DATA:-}")
  EVAL_DATA=$(md_abs "${EVAL_DATA:-}")
  INIT_CKPT=$(md_abs "${INIT_CKPT:-}")
  : "${GPUS_PER_NODE:=${SLURM_GPUS_ON_NODE:-8}}"
  : "${CPUS_PER_NODE:=${SLURM_CPUS_ON_NODE:-}}"
  : "${ROLLOUT_NODES:=0}"
  : "${ENGINE_GPUS:=1}"
  : "${NUM_ENGINES:=}"
  : "${ENGINE_CPUS:=}"
  : "${HEAD_IP:=}"
  : "${RAY_PORT:=6379}"
  : "${MASTER_PORT:=29500}"
  : "${RAY_WAIT_TIMEOUT_S:=300}"
  : "${RAY_POLL_S:=5}"
  : "${RAY_STOP_S:=60}"
  : "${STOP_GRACE_S:=240}"
  : "${REQUEUE_ON_TERM:=1}"
  : "${MAX_REQUEUES:=100}"
  : "${PREFLIGHT:=1}"
  : "${EXTRA_OVERRIDES:=}"
  local v
  for v in GPUS_PER_NODE ROLLOUT_NODES ENGINE_GPUS RAY_PORT MASTER_PORT RAY_WAIT_TIMEOUT_S RAY_STOP_S STOP_GRACE_S \
    MAX_REQUEUES; do
    [[ ${!v} =~ ^[0-9]+$ ]] || md_die "$v=${!v} must be a non-negative integer"
  done
  [[ $RAY_PORT != "$MASTER_PORT" ]] || md_die "RAY_PORT and MASTER_PORT are both $RAY_PORT: give them different ports"
}

md_env() {  # NCCL / torch settings for every step: exported when set, dropped when empty
  local v
  for v in $(compgen -v NCCL_) GLOO_SOCKET_IFNAME; do
    if [[ -n ${!v:-} ]]; then export "${v?}"; else unset "$v"; fi
  done
  if [[ -n ${NCCL_SOCKET_IFNAME:-} && -z ${GLOO_SOCKET_IFNAME:-} ]]; then
    export GLOO_SOCKET_IFNAME="$NCCL_SOCKET_IFNAME"
  fi
  # torchrun gives its ranks this long to exit after it forwards a SIGTERM (torch >= 2.8; older: 30 s)
  export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$STOP_GRACE_S}"
  export PYTHONUNBUFFERED=1
}

md_hosts() {  # MD_HOSTS: the allocation's hosts in Slurm's order; MD_HEAD: the first (runs this script)
  local list="${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}"
  [[ -n ${SLURM_JOB_ID:-} && -n $list ]] || md_die "no Slurm allocation (SLURM_JOB_ID / SLURM_JOB_NODELIST unset): \
submit with sbatch from the repository root"
  mapfile -t MD_HOSTS < <(scontrol show hostnames "$list")
  ((${#MD_HOSTS[@]} > 0)) || md_die "scontrol show hostnames '$list' printed no hosts"
  if [[ -n ${SLURM_NNODES:-} && $SLURM_NNODES != "${#MD_HOSTS[@]}" ]]; then
    md_die "SLURM_NNODES=$SLURM_NNODES but the node list '$list' has ${#MD_HOSTS[@]} hosts"
  fi
  MD_HEAD=${MD_HOSTS[0]}
}

md_join() {  # md_join SEP WORDS...: the words joined by SEP
  local sep=$1 out=$2
  shift 2
  local w
  for w in "$@"; do out+="$sep$w"; done
  printf '%s' "$out"
}

md_layout() {  # trainer nodes (the first ones, head included: rank 0 joins Ray there) and rollout nodes
  local n=${#MD_HOSTS[@]} rollout=0
  [[ $MD_CMD == rl ]] && rollout=$ROLLOUT_NODES
  ((rollout < n)) || md_die "ROLLOUT_NODES=$rollout leaves no trainer node out of $n: submit with more nodes \
(sbatch --nodes=N) or lower ROLLOUT_NODES"
  MD_TRAIN_NODES=$((n - rollout))
  MD_TRAIN_HOSTS=$(md_join , "${MD_HOSTS[@]:0:MD_TRAIN_NODES}")
  MD_ALL_HOSTS=$(md_join , "${MD_HOSTS[@]}")
  MD_WORLD=$((MD_TRAIN_NODES * GPUS_PER_NODE))
  if [[ $MD_CMD == rl ]]; then
    local rollout_gpus=$(((rollout > 0 ? rollout : n) * GPUS_PER_NODE))
    ((ENGINE_GPUS > 0 && rollout_gpus >= ENGINE_GPUS)) || md_die "ENGINE_GPUS=$ENGINE_GPUS: $rollout_gpus \
rollout GPUs cannot hold one engine"
    : "${NUM_ENGINES:=$((rollout_gpus / ENGINE_GPUS))}"
  fi
}

md_ray_gpus() {  # md_ray_gpus NODE_INDEX: GPUs Ray advertises there (none on trainer nodes when split)
  if ((ROLLOUT_NODES > 0 && $1 < MD_TRAIN_NODES)); then echo 0; else echo "$GPUS_PER_NODE"; fi
}

md_check_inputs() {
  [[ -f $MODEL/config.json ]] || md_die "MODEL=$MODEL has no config.json: set MODEL to the HF checkpoint directory"
  if [[ $MD_CMD != convert ]]; then
    [[ -e $DATA ]] || md_die "DATA=${DATA:-<unset>} does not exist: set DATA to the .jsonl / .parquet training data"
    [[ -z $EVAL_DATA || -e $EVAL_DATA ]] || md_die "EVAL_DATA=$EVAL_DATA does not exist"
    [[ -z $INIT_CKPT || -d $INIT_CKPT ]] || md_die "INIT_CKPT=$INIT_CKPT is not a directory"
  fi
}

md_setup() {  # md_setup NAME CMD: everything before the first job step
  MD_NAME=$1 MD_CMD=$2
  cd "$MEGADARE_ROOT" || md_die "cannot cd to MEGADARE_ROOT=$MEGADARE_ROOT"
  if [[ -n ${VENV:-} ]]; then
    # shellcheck source=/dev/null
    source "$VENV/bin/activate" || md_die "VENV=$VENV: cannot activate"
  fi
  md_defaults
  md_env
  md_hosts
  md_layout
  md_check_inputs
  mkdir -p "$RUN_DIR" "$LOG_DIR" || md_die "cannot create RUN_DIR=$RUN_DIR"
  printf '%(%F %T)T job %s restart %s on %s\n' -1 "$SLURM_JOB_ID" "${SLURM_RESTART_COUNT:-0}" "$MD_ALL_HOSTS" \
    >>"$LOG_DIR/jobs.log"
  md_log "$MD_NAME: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on ${#MD_HOSTS[@]} nodes: $MD_ALL_HOSTS"
}

md_step() {  # md_step HOSTS_CSV: MD_STEP = the srun prefix of a job step with one task on each of those hosts
  local n
  n=$(($(tr -cd , <<<"$1" | wc -c) + 1))
  MD_STEP=(srun --overlap --nodes="$n" --ntasks="$n" --ntasks-per-node=1 --nodelist="$1" --cpu-bind=none
    --chdir="$MEGADARE_ROOT")
  if [[ -n $CPUS_PER_NODE ]]; then MD_STEP+=(--cpus-per-task="$CPUS_PER_NODE"); fi
}

md_head_ip() {
  if [[ -z $HEAD_IP ]]; then
    md_step "$MD_HEAD"
    HEAD_IP=$("${MD_STEP[@]}" hostname --ip-address | awk '{print $1; exit}')
  fi
  [[ -n $HEAD_IP ]] || md_die "cannot find the IP address of $MD_HEAD: set HEAD_IP"
}

# ---------------------------------------------------------------------------------------------------- Ray

md_ray_auth() {  # one token per run for every Ray process of the job (workers, `ray status`, rank 0's driver).
  # Ray with token authentication turns it on in `ray start` when ~/.ray/auth_token exists, but `ray status` and
  # drivers only send a token when RAY_AUTH_MODE=token: without this the nodes never show as joined. Older Ray
  # ignores these variables. RAY_AUTH_MODE set by the user (e.g. disabled, or token + RAY_AUTH_TOKEN_PATH) wins.
  [[ -n ${RAY_AUTH_MODE:-} ]] && return 0
  export RAY_AUTH_MODE=token
  if [[ -z ${RAY_AUTH_TOKEN:-} && -z ${RAY_AUTH_TOKEN_PATH:-} ]]; then
    RAY_AUTH_TOKEN=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
    export RAY_AUTH_TOKEN
  fi
}

md_ray_count() {  # nodes `ray status` lists as active or idle (Ray >= 2.10 prints idle nodes apart)
  ray status --address="$HEAD_IP:$RAY_PORT" 2>"$LOG_DIR/ray-status.err" | awk '
    /^(Active|Idle):/ { on = 1; next }
    /^[A-Za-z].*:/    { on = 0 }
    on && $2 ~ /^node_/ { n += $1 }
    END { print n + 0 }'
}

md_ray_wait() {  # md_ray_wait N: until N nodes joined, or die after RAY_WAIT_TIMEOUT_S
  local want=$1 have=0 deadline=$((SECONDS + RAY_WAIT_TIMEOUT_S)) i
  while :; do
    have=$(md_ray_count)
    if ((have >= want)); then
      md_log "ray: $have/$want nodes joined $HEAD_IP:$RAY_PORT"
      return 0
    fi
    ((MD_STOPPING)) && exit 0
    for i in "${!MD_RAY_PIDS[@]}"; do
      kill -0 "${MD_RAY_PIDS[i]}" 2>/dev/null ||
        md_die "ray: \`ray start\` on ${MD_HOSTS[i]} exited; see $LOG_DIR/ray-${MD_HOSTS[i]}.log"
    done
    ((SECONDS < deadline)) || md_die "ray: only $have of $want nodes joined $HEAD_IP:$RAY_PORT within \
${RAY_WAIT_TIMEOUT_S}s (RAY_WAIT_TIMEOUT_S); see $LOG_DIR/ray-*.log; the last \`ray status\` said: \
$(tail -n 3 "$LOG_DIR/ray-status.err")"
    sleep "$RAY_POLL_S"
  done
}

md_ray_up() {  # head on the first node, workers on the others, each `ray start --block` in its own job step
  # (under the node wrapper: a SIGUSR2 to the step becomes SIGTERM to `ray start`, which stops this node's Ray)
  local i host
  ((MD_STOPPING)) && exit 0
  md_head_ip
  md_ray_auth
  md_log "ray: head on $MD_HEAD ($HEAD_IP:$RAY_PORT)"
  md_step "$MD_HEAD"
  "${MD_STEP[@]}" bash "$MD_COMMON" node-run ray start --head --block --node-ip-address="$HEAD_IP" \
    --port="$RAY_PORT" --num-gpus="$(md_ray_gpus 0)" --include-dashboard=false --disable-usage-stats \
    >>"$LOG_DIR/ray-$MD_HEAD.log" 2>&1 &
  MD_RAY_PIDS=($!)
  md_ray_wait 1
  for ((i = 1; i < ${#MD_HOSTS[@]}; i++)); do
    host=${MD_HOSTS[i]}
    md_step "$host"
    "${MD_STEP[@]}" bash "$MD_COMMON" node-run ray start --block --address="$HEAD_IP:$RAY_PORT" \
      --num-gpus="$(md_ray_gpus "$i")" --disable-usage-stats >>"$LOG_DIR/ray-$host.log" 2>&1 &
    MD_RAY_PIDS+=($!)
  done
  md_ray_wait "${#MD_HOSTS[@]}"
  export RAY_ADDRESS="$HEAD_IP:$RAY_PORT"  # megadare's rank 0 joins this cluster (ray.init(address=...))
}

md_ray_down() {  # this job's Ray only: SIGUSR2 to each `ray start --block` step (srun forwards it; the wrapper
  # sends SIGTERM to `ray start`, which stops the Ray processes it started). Not `ray stop`: that kills every Ray
  # process of the user on the node, other jobs' included. A step still running after RAY_STOP_S is killed.
  ((${#MD_RAY_PIDS[@]})) || return 0
  local pid deadline=$((SECONDS + RAY_STOP_S))
  md_log "ray: stopping on ${#MD_HOSTS[@]} nodes"
  for pid in "${MD_RAY_PIDS[@]}"; do kill -USR2 "$pid" 2>/dev/null; done
  for pid in "${MD_RAY_PIDS[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      md_log "ray: a node's Ray still running after ${RAY_STOP_S}s (RAY_STOP_S): killing its step"
      kill -TERM "$pid" 2>/dev/null
    fi
    wait "$pid" 2>/dev/null
  done
  MD_RAY_PIDS=()
  md_log "ray: stopped"
}

# ---------------------------------------------------------------------------------------------------- trainer

md_overrides() {  # MD_OVERRIDES: the key=value overrides the trainer (and the preflight check) get
  MD_OVERRIDES=("model.hf_path=$MODEL" "data.path=$DATA" "logging.run_dir=$RUN_DIR" "checkpoint.save=$CKPT"
    "parallel.world_size=$MD_WORLD")
  [[ -n $EVAL_DATA ]] && MD_OVERRIDES+=("data.eval_path=$EVAL_DATA")
  [[ -n $INIT_CKPT ]] && MD_OVERRIDES+=("checkpoint.load=$INIT_CKPT")
  if [[ $MD_CMD == rl ]]; then
    MD_OVERRIDES+=("rollout.num_engines=$NUM_ENGINES"
      "rollout.engine_resources={num_gpus: $ENGINE_GPUS${ENGINE_CPUS:+, num_cpus: $ENGINE_CPUS}}"
      "rollout.engine_tp=$ENGINE_GPUS")
  fi
  local extra
  read -ra extra <<<"$EXTRA_OVERRIDES"
  MD_OVERRIDES+=("${extra[@]}")
}

md_preflight() {  # the config, the overrides, the model, the data and the run directory, before any step starts
  local only=()
  case $PREFLIGHT in
    0) return 0 ;;
    1) ;;
    config) only=(--config-only) ;;
    *) md_die "PREFLIGHT=$PREFLIGHT must be 1, config or 0" ;;
  esac
  md_log "checking $MD_CONFIG with the trainer's overrides (megadare $MD_CMD --dry-run ${only[*]})"
  # into a file of this job, renamed once the check passed: a job refused (another job's live run on RUN_DIR)
  # left that run's resolved config empty
  local resolved="$LOG_DIR/resolved-config.yaml" tmp="$LOG_DIR/resolved-config.yaml.$SLURM_JOB_ID.tmp"
  if ! "$PYTHON" -m megadare "$MD_CMD" --config "$MD_CONFIG" --dry-run "${only[@]}" "${MD_OVERRIDES[@]}" >"$tmp"; then
    rm -f "$tmp"
    md_die "megadare $MD_CMD --dry-run rejected the config (see above)"
  fi
  mv -f "$tmp" "$resolved"
}

md_port_taken() {  # md_port_taken PORT: true when a process on this host listens on TCP port PORT (any address;
  # the kernel's socket tables, not a connection: a network that accepts every connection would answer for all)
  local tables=() t
  for t in /proc/net/tcp /proc/net/tcp6; do [[ -r $t ]] && tables+=("$t"); done
  ((${#tables[@]})) || return 1
  awk -v port="$(printf '%04X' "$1")" 'FNR > 1 && $4 == "0A" { n = split($2, a, ":"); if (a[n] == port) found = 1 }
    END { exit !found }' "${tables[@]}"
}

md_ephemeral_ports() {  # the kernel's range for ports bound to 0 ("32768-60999"), where Ray's random ports fall
  local lo hi
  read -r lo hi </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null && printf '%s-%s' "$lo" "$hi" || printf 'unknown'
}

md_launch_trainer() {  # one torchrun per trainer node, in one job step
  ((MD_STOPPING)) && exit 0
  # checked after Ray is up, on this node (the head: rank 0's torchrun listens here): Ray's own ports are picked at
  # random, and torchrun would end in a traceback
  if md_port_taken "$MASTER_PORT"; then
    md_die "MASTER_PORT=$MASTER_PORT is taken on $(hostname) (another process listens there): set MASTER_PORT to a \
free port, outside Ray's ranges (worker ports 10002-19999 and the ephemeral range $(md_ephemeral_ports))"
  fi
  md_log "trainer: $MD_TRAIN_NODES nodes x $GPUS_PER_NODE GPUs, master $HEAD_IP:$MASTER_PORT; resumes from the \
newest checkpoint under $CKPT if there is one"
  export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"  # megatron's TP/SP overlap needs it
  md_step "$MD_TRAIN_HOSTS"
  "${MD_STEP[@]}" --kill-on-bad-exit=1 bash "$MD_COMMON" node-torchrun "$MD_TRAIN_HOSTS" \
    --nnodes="$MD_TRAIN_NODES" --nproc_per_node="$GPUS_PER_NODE" --master_addr="$HEAD_IP" \
    --master_port="$MASTER_PORT" -m megadare "$MD_CMD" --config "$MD_CONFIG" "${MD_OVERRIDES[@]}" &
  MD_TRAINER_PID=$!
}

md_wait_pid() {  # md_wait_pid PID: its exit status; a trapped signal does not end the wait; after a stop
  # request (MD_STOP_DEADLINE) the step is killed (SIGTERM to srun = SIGKILL to its tasks) once the grace is over
  local pid=$1 rc=0
  while :; do
    if [[ -n $MD_STOP_DEADLINE ]]; then
      if ! kill -0 "$pid" 2>/dev/null; then
        wait "$pid"
        return
      fi
      if ((SECONDS >= MD_STOP_DEADLINE)); then
        md_log "trainer still running ${STOP_GRACE_S}s after SIGTERM (STOP_GRACE_S): killing it"
        kill -TERM "$pid" 2>/dev/null
        MD_STOP_DEADLINE=
      fi
      sleep 1
      continue
    fi
    wait "$pid"
    rc=$?
    kill -0 "$pid" 2>/dev/null || break  # exited; otherwise a trapped signal interrupted the wait
  done
  if ((rc > 128)); then  # the interrupted wait raced the exit: bash still holds the real status
    wait "$pid" 2>/dev/null
    local again=$?
    ((again == 127)) || rc=$again
  fi
  return "$rc"
}

md_stop_trainer() {  # ask every rank to checkpoint and exit (srun forwards SIGUSR2 to the node wrappers)
  [[ -n $MD_TRAINER_PID ]] && kill -0 "$MD_TRAINER_PID" 2>/dev/null || return 0
  [[ -n $MD_STOP_DEADLINE ]] && return 0
  md_log "trainer: forwarding SIGTERM to every rank (checkpoint, then exit); killed after ${STOP_GRACE_S}s"
  MD_STOP_DEADLINE=$((SECONDS + STOP_GRACE_S))
  kill -USR2 "$MD_TRAINER_PID" 2>/dev/null
}

md_on_signal() {  # USR1 (time limit near, --signal=B:USR1@300), TERM (preemption), INT (stop for good)
  local sig=$1
  md_log "caught SIG$sig"
  case $sig in
    USR1) MD_REQUEUE=1 ;;
    TERM) ((REQUEUE_ON_TERM)) && MD_REQUEUE=1 ;;
  esac
  MD_STOPPING=1
  md_stop_trainer
}

md_on_exit() {
  local rc=$?
  set +e
  trap 'md_log "already stopping"' USR1 TERM INT  # trapped, not ignored: job steps started now keep defaults
  if [[ -n $MD_TRAINER_PID ]] && kill -0 "$MD_TRAINER_PID" 2>/dev/null; then
    md_stop_trainer
    md_wait_pid "$MD_TRAINER_PID"
  fi
  md_ray_down
  if ((MD_REQUEUE)); then
    if ((${SLURM_RESTART_COUNT:-0} >= MAX_REQUEUES)); then
      md_log "not requeueing: restart ${SLURM_RESTART_COUNT:-0} reached MAX_REQUEUES=$MAX_REQUEUES"
    elif scontrol requeue "$SLURM_JOB_ID"; then
      md_log "requeued job $SLURM_JOB_ID: the next run resumes from the newest checkpoint under ${CKPT:-RUN_DIR}"
      rc=0
    else
      md_log "scontrol requeue $SLURM_JOB_ID failed: resubmit with the same RUN_DIR to resume"
    fi
  fi
  md_log "exit $rc"
  exit "$rc"
}

md_traps() {
  trap 'md_on_signal USR1' USR1
  trap 'md_on_signal TERM' TERM
  trap 'md_on_signal INT' INT
  trap md_on_exit EXIT
}

md_main() {  # md_main rl|sft CONFIG
  local cmd=$1
  MD_CONFIG=$2
  md_setup "$(basename "$MD_CONFIG" .yaml)" "$cmd"
  md_traps
  md_overrides
  md_preflight
  if [[ $cmd == rl ]]; then
    md_ray_up
  else
    md_head_ip
  fi
  md_launch_trainer
  md_wait_pid "$MD_TRAINER_PID"
  local rc=$?
  MD_TRAINER_PID=
  md_log "trainer exited with $rc"
  exit "$rc"
}

md_convert() {  # HF -> Megatron checkpoint on one node; knobs MODEL OUT TP PP EP ETP VPP DTYPE FORCE
  md_setup convert convert
  md_traps
  OUT=$(md_abs "${OUT:-}")
  [[ -n $OUT ]] || md_die "set OUT to the output checkpoint directory"
  if [[ -f $OUT/metadata.json && ${FORCE:-0} != 1 ]]; then
    md_log "$OUT is already a complete checkpoint (FORCE=1 converts again)"
    exit 0
  fi
  local args=(tools/checkpoint_convert/hf_to_megatron.py --hf "$MODEL" --out "$OUT" --tp "${TP:-1}" --pp "${PP:-1}"
    --ep "${EP:-1}" --dtype "${DTYPE:-keep}")
  [[ -n ${ETP:-} ]] && args+=(--etp "$ETP")
  [[ -n ${VPP:-} ]] && args+=(--vpp "$VPP")
  ((MD_STOPPING)) && exit 0
  md_step "$MD_HEAD"
  "${MD_STEP[@]}" bash "$MD_COMMON" node-run "$PYTHON" "${args[@]}" &
  MD_TRAINER_PID=$!
  md_wait_pid "$MD_TRAINER_PID"
  local rc=$?
  MD_TRAINER_PID=
  md_log "converter exited with $rc"
  exit "$rc"
}

# ---------------------------------------------------------------------------------------------------- per node

md_node_stop() {  # SIGUSR2 / SIGTERM / SIGINT on a node: SIGTERM to the ranks (torchrun's children) or the command
  [[ -n ${MD_NODE_PID:-} ]] || return 0
  if [[ $MD_NODE_TARGET == children ]]; then
    pkill -TERM -P "$MD_NODE_PID" || kill -TERM "$MD_NODE_PID" 2>/dev/null
  else
    kill -TERM "$MD_NODE_PID" 2>/dev/null
  fi
}

md_node_run() {  # md_node_run children|self CMD...
  MD_NODE_TARGET=$1
  MD_NODE_PID=
  shift
  trap md_node_stop USR2 TERM INT
  (
    trap '' USR2  # ignored across exec: srun may deliver SIGUSR2 to every process of the step
    exec "$@"
  ) &
  MD_NODE_PID=$!
  md_wait_pid "$MD_NODE_PID"
}

md_node_torchrun() {  # md_node_torchrun TRAINER_HOSTS TORCHRUN_ARGS...
  local hosts me rank=-1 i
  IFS=, read -ra hosts <<<"$1"
  shift
  me=${SLURMD_NODENAME:-$(hostname -s)}
  for i in "${!hosts[@]}"; do
    [[ ${hosts[i]} == "$me" ]] && rank=$i
  done
  ((rank >= 0)) || rank=${SLURM_NODEID:?"$me is not a trainer host and SLURM_NODEID is unset"}
  md_node_run children torchrun --node_rank="$rank" "$@"
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then  # executed (by srun), not sourced
  set -uo pipefail
  case ${1:-} in
    node-torchrun)
      shift
      md_node_torchrun "$@"
      ;;
    node-run)
      shift
      md_node_run self "$@"
      ;;
    *)
      echo "usage: bash $0 node-torchrun TRAINER_HOSTS TORCHRUN_ARGS... | node-run CMD..." >&2
      exit 2
      ;;
  esac
fi
