# The GPU learning runs of recipes/grpo_arith3_gpu.yaml, in device calls of at most 10 minutes.
# Source it in a call (after install.sh, or env.sh on a warm machine), then:
#   learn DIR RUN...      RUN: fsdp2 | megatron | async (fsdp2, one step off, token_tis)
#                         | async-megatron (Megatron, one step off, vLLM resident)
#                         | fp8 (fsdp2, FP8 rollouts, token-level truncated IS) | fp8-megatron
#                         | sglang (fsdp2, SGLang generating: its processes take SGLANG_SITE, default
#                           /tmp/site-sglang, first on PYTHONPATH, as benchmarks/gpu/README.md installs it)
#   learn_together DIR RUN...  the same runs started at once on the one GPU, engines resident
#                         (colocated.sleep_level=0): at 141M parameters the GPU is mostly idle, and three
#                         runs together take about 1.1 s a step each
#   learn_eval_bf16 DIR RUN   greedy held-out accuracy of each checkpoint RUN kept, through a bf16
#                         engine (`rlcore eval`, one process per checkpoint, side by side), as
#                         $OUT/grpo-RUN-bf16.metrics.jsonl for plot_learning.py
# DIR is a work directory on the machine outside the checkout (e.g. /root/learn): the SFT warm
# start, the runs and their checkpoints stay there between calls while the machine stays warm.
# - The SFT warm start runs first when DIR has none (SFT_ARGS, below).
# - The runs go one after the other; each resumes from its newest checkpoint in DIR/grpo-RUN
#   when an earlier call left one, and a run that finished is not started again. They cannot share
#   the GPU: a colocated engine's sleep checks that the GPU's free memory grew, and fails
#   ("Memory usage increased after sleeping") when another process allocated meanwhile;
#   learn_together keeps every engine awake instead.
# - At LEARN_DEADLINE (seconds since the call began) a run still going gets SIGTERM: it finishes
#   its step, writes a checkpoint of it and exits (status 143), and the next call's `learn` goes on
#   from there. Logs, metrics.jsonl and the SFT history are copied to $OUT after every call.
RECIPE=recipes/grpo_arith3_gpu.yaml
SFT_ARGS=${SFT_ARGS:---sft-target 0.2 --sft-batch-size 256 --sft-lr 3e-4 --sft-warmup 50 --sft-eval-every 10 --sft-max-steps 4000}

learn_overrides() {
  case $1 in
    fsdp2) ;;
    megatron) echo "policy.dtensor_cfg.enabled=false policy.megatron_cfg.enabled=true" ;;
    # One step off, corrected for the one-step-stale generator by token-level truncated IS.
    async) echo "grpo.async_grpo.enabled=true algorithm.rollout_correction.preset=token_tis" ;;
    async-megatron) echo "policy.dtensor_cfg.enabled=false policy.megatron_cfg.enabled=true grpo.async_grpo.enabled=true algorithm.rollout_correction.preset=token_tis" ;;
    # fsdp2 with FP8 rollouts. Checkpoints of the last 20% of steps stay, for learn_eval_bf16: the FP8
    # engine's own validation scores the FP8-quantized policy, not the bf16 weights the run trains
    # (fsdp2's checkpoints export on the CPU; a Transformer Engine Megatron checkpoint needs TE there).
    fp8) echo "policy.generation.quantization=fp8 algorithm.rollout_correction.preset=token_tis checkpointing.save_period=10 checkpointing.keep_last_k=5" ;;
    fp8-megatron) echo "policy.dtensor_cfg.enabled=false policy.megatron_cfg.enabled=true policy.generation.quantization=fp8 algorithm.rollout_correction.preset=token_tis" ;;
    # The recipe's vLLM-only keys go; SGLang's own bounds the batch as max_num_seqs does for vLLM.
    sglang) echo "policy.generation.backend=sglang ~policy.generation.max_num_seqs ~policy.generation.gpu_kv_cache_gib policy.generation.max_running_requests=512" ;;
    *) echo "learn: unknown run '$1' (fsdp2, megatron, async, async-megatron, fp8, fp8-megatron, sglang)" >&2; return 1 ;;
  esac
}

learn_sft() {  # the SFT warm start in DIR, unless DIR has one
  local dir=$1 deadline=${LEARN_DEADLINE:-540}
  export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
  mkdir -p "$dir"
  if [ ! -f "$dir/sft/config.json" ]; then
    # shellcheck disable=SC2086
    timeout -k 10 $((deadline - SECONDS)) python3 -m rlcore.cli.demo --recipe $RECIPE --shape llama150m --out "$dir" \
      --sft-only $SFT_ARGS > "$OUT/sft.log" 2>&1
    echo "sft: rc=$? at ${SECONDS}s" >> "$OUT/jobs.txt"
  fi
  [ -f "$dir/sft/sft_history.json" ] && cp "$dir/sft/sft_history.json" "$OUT/"
  [ -f "$dir/sft/config.json" ]
}

learn_start() {  # DIR RUN [override...]: start RUN in the background (pid in LEARN_PID), unless it finished
  local dir=$1 run=$2; shift 2
  LEARN_PID=
  if [ -f "$dir/grpo-$run/summary.json" ] && ! grep -q '"stopped_by_signal": "' "$dir/grpo-$run/summary.json"; then
    return 0  # finished in an earlier call
  fi
  [ "$SECONDS" -lt "$((${LEARN_DEADLINE:-540} - 60))" ] || { echo "grpo-$run: not started, ${SECONDS}s gone" >> "$OUT/jobs.txt"; return 0; }
  # shellcheck disable=SC2046
  # setsid: the run leads its own process group, so what it leaves behind (its grader pool) goes with it (learn_wait).
  # A call's own time limit does not reach that group: LEARN_DEADLINE must stay under it, as it does (480-540 of 600 s).
  # cluster.exit_timeout_s=30: a run that has ended but does not exit prints its threads' stacks and exits
  # within the call, not after the default 300 s.
  local site=
  case $run in sglang*) site=${SGLANG_SITE:-/tmp/site-sglang}: ;; esac
  setsid env PYTHONPATH="$site$PYTHONPATH" python3 -m rlcore.cli run $RECIPE "policy.model_name=$dir/sft" "logger.log_dir=$dir/grpo-$run" \
    cluster.exit_timeout_s=30 $(learn_overrides "$run") "$@" >> "$OUT/grpo-$run.log" 2>&1 &
  LEARN_PID=$!
}

learn_wait() {  # RUN:PID...: wait until they end or LEARN_DEADLINE; then SIGTERM (end the step, checkpoint, exit)
  local deadline=${LEARN_DEADLINE:-540} item alive grace
  while :; do
    alive=0
    for item in "$@"; do kill -0 "${item#*:}" 2>/dev/null && alive=1; done
    [ "$alive" = 1 ] && [ "$SECONDS" -lt "$deadline" ] || break
    sleep 1
  done
  # A run still going at the deadline first prints every thread's stack to its log (rlcore's SIGUSR1): a run
  # that has ended its steps and not exited shows there what holds it.
  for item in "$@"; do
    kill -0 "${item#*:}" 2>/dev/null || continue
    kill -USR1 "${item#*:}" && echo "grpo-${item%%:*}: stacks at ${SECONDS}s in its log" >> "$OUT/jobs.txt" && sleep 2
  done
  for item in "$@"; do kill -TERM "${item#*:}" 2>/dev/null; done
  grace=$((SECONDS + ${LEARN_GRACE:-40}))
  for item in "$@"; do
    while kill -0 "${item#*:}" 2>/dev/null && [ "$SECONDS" -lt "$grace" ]; do sleep 1; done
    kill -KILL "${item#*:}" 2>/dev/null
    wait "${item#*:}"; echo "grpo-${item%%:*}: rc=$? at ${SECONDS}s" >> "$OUT/jobs.txt"
    kill -KILL -- "-${item#*:}" 2>/dev/null  # its children, after the run itself ended (SIGTERM to them first would cut its last step)
  done
}

learn_collect() {  # DIR RUN...: metrics to $OUT
  local dir=$1 run; shift
  for run in "$@"; do
    [ -f "$dir/grpo-$run/metrics.jsonl" ] && cp "$dir/grpo-$run/metrics.jsonl" "$OUT/grpo-$run.metrics.jsonl"
  done
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$OUT/jobs.txt" 2>&1
}

learn() {
  local dir=$1 run; shift
  learn_sft "$dir" || return 1
  for run in "$@"; do
    learn_start "$dir" "$run"
    [ -n "$LEARN_PID" ] && learn_wait "$run:$LEARN_PID"
  done
  learn_collect "$dir" "$@"
}

learn_together() {
  local dir=$1 run pids=(); shift
  learn_sft "$dir" || return 1
  for run in "$@"; do
    learn_start "$dir" "$run" policy.generation.colocated.sleep_level=0
    [ -n "$LEARN_PID" ] && pids+=("$run:$LEARN_PID")
  done
  [ "${#pids[@]}" -gt 0 ] && learn_wait "${pids[@]}"
  learn_collect "$dir" "$@"
}

learn_eval_bf16() {  # the checkpoints' evaluations run side by side: each starts its own engine (most of its time)
  local dir=$1 run=$2 ckpt step pids=() steps=()
  export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
  for ckpt in "$dir/grpo-$run"/checkpoints/step_*; do
    [ -d "$ckpt" ] || continue
    step=$((10#${ckpt##*step_}))
    python3 -m rlcore.cli eval "$ckpt" $RECIPE policy.generation.quantization=none policy.generation.enforce_eager=true \
      --no-progress --out "$dir/eval-$run-$step.json" > "$OUT/eval-$run-$step.log" 2>&1 &
    pids+=($!); steps+=("$step")
  done
  local i
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; echo "eval $run step ${steps[$i]}: rc=$? at ${SECONDS}s" >> "$OUT/jobs.txt"
  done
  for step in $(printf '%s\n' "${steps[@]}" | sort -n); do
    python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print(json.dumps({'step': int(sys.argv[2]), 'val/accuracy': s['greedy_accuracy']}))" \
      "$dir/eval-$run-$step.json" "$step" >> "$OUT/grpo-$run-bf16.metrics.jsonl" 2>> "$OUT/eval-$run-$step.log"
  done
}
