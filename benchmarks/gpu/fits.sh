# Every single-GPU 1.2B configuration of bench_grpo_step.py with no memory key set (the run's memory plan
# chooses the engine's share and whether the trainer's state leaves the GPU), across device calls of at most
# 10 minutes. Source it in a call after jobs.sh (and install.sh, or env.sh on a warm machine), then:
#   fits [CONFIG...]        the list below by default; a configuration done in an earlier call on the same
#                           machine is not run again (FITS_DONE holds a marker per configuration)
# Each row of results.jsonl carries the plan's memory per phase beside the measured peaks (memory_plan/*,
# memory/*); the rows are copied to $OUT/results.jsonl after every configuration, since the checkout's copy
# is replaced by the next call's.
FITS=(llama1b-megatron llama1b-fsdp2 llama1b-megatron-cuda-graph llama1b-fsdp2-compile llama1b-megatron-ppo
      llama1b-fsdp2-ppo llama1b-megatron-fp8gen llama1b-tool-async llama1b-tool-agent llama1b-multiturn-async
      llama1b-multiturn-sync-barrier)
# Shapes no calibration read, for the planner's held-out rows: `fits "${HELD_OUT_SHAPES[@]}"`
HELD_OUT_SHAPES=(llama0.5b-megatron llama0.5b-fsdp2 llama3b-megatron-lora llama3b-fsdp2-lora)
FITS_DONE=${FITS_DONE:-/root/fits-done}

# Two steps, the first a warm-up: the second is the steady state (the first trains and generates before the
# optimizer's first step creates its state, so its memory is not the plan's). The turn barrier's step is two minutes
# of simulated tool latency: one step, its first, compared for its engine-awake memory (the refit follows the step).
fits_steps() {
  case $1 in *multiturn-sync*) echo "--steps 1 --warmup 0" ;; *) echo "--steps 2 --warmup 1" ;; esac
}

# One GRPO step benchmark of CONFIG as job NAME: settings PYTORCH_CUDA_ALLOC_CONF=... go to its environment, the
# others (KEY=VALUE) to --set.
fits_job() {
  local name=$1 config=$2 envs=() sets=() setting; shift 2
  for setting in "$@"; do
    case $setting in PYTORCH_CUDA_ALLOC_CONF=*) envs+=("$setting") ;; *) sets+=(--set "$setting") ;; esac
  done
  # shellcheck disable=SC2046
  job "$name" 300 150 env "${envs[@]}" python3 benchmarks/bench_grpo_step.py --config "$config" $(fits_steps "$config") "${sets[@]}"
}

fits() {
  local config
  mkdir -p "$FITS_DONE"
  for config in "${@:-${FITS[@]}}"; do
    [ -e "$FITS_DONE/$config" ] && continue
    fits_job "$config" "$config"
    grep -q '^'"$config"': rc=0' "$OUT/jobs.txt" && touch "$FITS_DONE/$config"
    cp benchmarks/results.jsonl "$OUT/results.jsonl"
  done
}

# A configuration with no memory key beside the same one with hand-set memory settings, back to back in one call
# (generation varies by tens of percent from call to call, so only a pair from one call compares):
#   fits_pair CONFIG KEY=VALUE...     e.g. fits_pair llama1b-megatron policy.generation.gpu_memory_utilization=0.5
# A setting PYTORCH_CUDA_ALLOC_CONF=... goes to the environment instead (fits_pair CONFIG PYTORCH_CUDA_ALLOC_CONF=:
# rlcore.run's allocator default beside torch's own defaults). The hand-set row's variant names its settings
# ([key=value]); a pair done in an earlier call is not run again. FITS_PAIR_ORDER (A: no memory key, B: hand-set;
# default AB) repeats them: ABBA gives each side a first and a second place, so a drift over the call (the host's
# load, the GPU's clock) falls on both; one run's generation alone varies by 20-25% within a call. A pair longer than
# one call goes on in the next call on the same machine from its first run not done (a marker per run).
fits_pair() {
  local config=$1 marker order=${FITS_PAIR_ORDER:-AB} which name i=0; shift
  marker="$FITS_DONE/pair-$config-$order-$(echo "$*" | md5sum | cut -c1-8)"
  mkdir -p "$FITS_DONE"
  for which in $(echo "$order" | grep -o .); do
    i=$((i + 1))
    [ -e "$marker.$i" ] && continue
    name=$config; [ "$which" = B ] && name=$config-hand-set
    [ $i -gt 2 ] && name=$name-$i
    if [ "$which" = A ]; then fits_job "$name" "$config"; else fits_job "$name" "$config" "$@"; fi
    grep -q '^'"$name"': rc=0' "$OUT/jobs.txt" && touch "$marker.$i"
    cp benchmarks/results.jsonl "$OUT/results.jsonl"
  done
}

# The memory settings each configuration was run with by hand on one GPU before the run's memory plan chose them
# (the rows of those runs carry them in their variant): `fits_hand_set [CONFIG...]` runs each configuration's pair,
# no memory key against those settings (FITS_PAIR_ORDER applies; all of them by default).
declare -gA HAND_SET=(
  [llama1b-megatron-cuda-graph]="policy.generation.gpu_memory_utilization=0.3"
  [llama1b-multiturn-async]="policy.generation.gpu_memory_utilization=0.2 policy.megatron_cfg.empty_unused_memory_level=1"
  [llama1b-megatron-ppo]="policy.generation.gpu_memory_utilization=0.25 policy.megatron_cfg.empty_unused_memory_level=1"
  [llama1b-fsdp2-ppo]="policy.generation.gpu_memory_utilization=0.25"
)
fits_hand_set() {
  local config
  for config in "${@:-${!HAND_SET[@]}}"; do
    # shellcheck disable=SC2086
    fits_pair "$config" ${HAND_SET[$config]}
  done
}
