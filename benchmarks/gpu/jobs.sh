# Several benchmark runs in one device call, none allowed past the call's limit. Source it in
# the call's command, then:  job NAME CAP_S MIN_S CMD...
# runs CMD under `timeout min(CAP_S, seconds left before DEADLINE)`, or skips it when fewer than
# MIN_S seconds are left; output in $OUT/NAME.log, one status line per job in $OUT/jobs.txt.
# DEADLINE (seconds since the call started, default 570) stays under the call's 600 s limit, so
# one failed or slow run never costs the others their results.
DEADLINE=${DEADLINE:-570}
job() {
  local name=$1 cap=$2 min=$3; shift 3
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt "$min" ]; then echo "$name: skipped ($left s left)" >> "$OUT/jobs.txt"; return; fi
  local limit=$(( cap < left ? cap : left )) start=$SECONDS rc load cpu_before pids_before
  load=$(host_load)
  cpu_before=$(cpu_times)
  pids_before=$(user_pids)
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1; rc=$?
  echo "$name: rc=$rc, limit ${limit}s, took $((SECONDS - start))s; before it: $load; during it: $(cpu_use "$cpu_before")" >> "$OUT/jobs.txt"
  echo "$name: left running:$(left_running "$pids_before")" >> "$OUT/jobs.txt"
  gpu_clear "$name"
}
# A run must leave nothing running when it ends (a Ray daemon, an engine's process, a compile worker): one that did
# would also slow the next job's host-bound generation. The processes started during a job and still alive after
# it, with their age (s), lifetime CPU share and command; asked again each second for up to 5 s while any is left,
# since a run's own clean-up may outlive it by seconds (rlcore.controller.ray_local's reaper notices its driver's
# end within half a second, then gives what is left 3 s to end).
user_pids() {
  ps -eo pid=,ppid=,stat= | awk '$1 != 2 && $2 != 2 && $3 !~ /^Z/ {print $1}' | sort  # no kernel threads, no zombies
}
left_running() {
  local pid line out="" tries=0
  while [ -n "$(comm -13 <(echo "$1") <(user_pids))" ] && [ $tries -lt 5 ]; do sleep 1; tries=$((tries + 1)); done
  for pid in $(comm -13 <(echo "$1") <(user_pids)); do
    line=$(ps -o pid=,stat=,etimes=,pcpu=,args= -p "$pid" 2>/dev/null | awk '$2 !~ /^Z/' | cut -c1-160)
    [ -n "$line" ] && [ "$pid" != "$$" ] && [ "$pid" != "$BASHPID" ] && out+=" ${line#"${line%%[![:space:]]*}"};"
  done
  echo "${out:- none}"
}
# The host's load and its busiest processes: the 1.2B engine is host-bound, so a process left busy by an
# earlier job slows the next one's generation (a 1.2B sync step's generation can grow by half).
host_load() {
  echo "load $(cut -d' ' -f1 /proc/loadavg), busiest $(ps -eo pcpu=,comm= --sort=-pcpu | head -3 | tr -s ' ' | paste -sd, -)"
}
# The CPUs' time counters (/proc/stat: user nice system idle iowait irq softirq steal), and what they say about
# the interval since a sample: the share of all CPUs busy, the share a VM's host took for others (steal), and
# the mean clock now. The same sync step's generation can vary by half at the same load: a host slowed from
# outside the VM shows as steal or a lower clock.
cpu_times() {
  head -1 /proc/stat | cut -d' ' -f3-10
}
cpu_use() {
  local after mhz
  after=$(cpu_times)
  mhz=$(awk -F: '/^cpu MHz/ {sum += $2; n++} END {if (n) printf "%.0f", sum / n; else printf "unknown"}' /proc/cpuinfo)
  echo "$1 $after" | awk -v mhz="$mhz" '{
    for (i = 1; i <= 8; i++) d[i] = $(i + 8) - $i
    total = 0; for (i = 1; i <= 8; i++) total += d[i]
    if (total <= 0) { printf "no CPU time counted, clock %s MHz", mhz; exit }
    printf "CPUs busy %.1f%%, steal %.2f%%, clock %s MHz", 100 * (total - d[4] - d[5]) / total, 100 * d[8] / total, mhz
  }'
}
# What a job cut by its limit leaves on the GPU (a child process of its own session, Ray's workers)
# would hold memory the next job needs: stop every process still holding the GPU.
gpu_clear() {
  local pids
  # (an MPS server a job started and stops itself is not a leftover)
  pids=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null | grep -v mps-server | cut -d, -f1 | tr -d ' ')
  [ -z "$pids" ] && return
  echo "$1: stopped processes it left on the GPU: $(echo $pids)" >> "$OUT/jobs.txt"
  ray stop --force > /dev/null 2>&1
  kill -9 $pids 2> /dev/null
  sleep 3
}
