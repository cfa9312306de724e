#!/usr/bin/env bash
# Edge soak (minutes; not in CI): under real address-space limits (prlimit --as, in bytes:
# util-linux 2.38 reads "3GiB" as 3 bytes), search each case's boundary, then run single probes
# (`--at X`) at the boundary and just beyond it, and print the outcome table.
#
# Fails (exit 1) on any `error` outcome, any panic that is not a `crashed` result, any probe
# that ran past its time limit, any search that found a boundary and did not exit 0, or any
# exit code that does not match the outcome (0 for results, 1 only for `error`).
#
# Usage: scripts/soak.sh [PROBES_PER_CASE]   (default 13: 4 limits x 2 cases x 13 = 104 probes)
# Env:   OOMPROBE=path/to/oomprobe (default: target/release/oomprobe, built if missing)
#        SOAK_LIMITS="1610612736 2147483648" (bytes)   SOAK_CASES="params|batch|seq-naive|seq-flash"
#        SOAK_TIMEOUT=120 (seconds per probe)
set -uo pipefail
cd "$(dirname "$0")/.."

per_case=${1:-13}
bin=${OOMPROBE:-target/release/oomprobe}
if [ ! -x "$bin" ]; then
  cargo build --release --quiet || exit 1
fi
limits=${SOAK_LIMITS:-"1610612736 2147483648 3221225472 4294967296"}
cases=${SOAK_CASES:-"batch seq-naive"}
timeout=${SOAK_TIMEOUT:-120}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

case_args() {
  case "$1" in
    params) echo "--scenario params" ;;
    batch) echo "--model tiny-gpt --scenario batch" ;;
    seq-naive) echo "--model tiny-gpt --scenario seq --attention naive" ;;
    seq-flash) echo "--model tiny-gpt --scenario seq --attention flash" ;;
    *) echo "unknown case $1" >&2; exit 2 ;;
  esac
}

json_field() { # FILE EXPR: a python expression over `r` (the report)
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print($2)" "$1" 2>/dev/null
}

bad=0
# Faults that must be refused or survived the same way every time (issue 23): each line is
# "name|expected exit|environment|command". Printed as a table first; a wrong exit fails the soak.
mkfifo "$work/fifo"
ln -s /proc/self/fd/1 "$work/stdout-link"
head -c $((17 << 20)) /dev/zero | tr '\0' ' ' >"$work/huge.json"
tiny="--model tiny-gpt --scenario batch --budget 24MiB --quiet"
# Issue 35's inputs: a pickle nested 2e5 deep; a real snapshot whose trace sizes are all 2^62.
python3 -c "open('$work/nested.pickle','wb').write(b'\x80\x02'+b']'*200000+b'a'*199999+b'.')"
python3 - "$PWD/tests/fixtures/snapshots/gpt2-tiny-b1.pickle" "$work/huge-sizes.pickle" <<'PY'
import pickle, sys
s = pickle.load(open(sys.argv[1], "rb"))
for dev in s["device_traces"]:
    for e in dev:
        e["size"] = 1 << 62
pickle.dump(s, open(sys.argv[2], "wb"))
PY
profiled="$PWD/tests/fixtures/snapshots/variants/profile-to-snapshot-cpu.pickle"
echo "| fault | expected exit | exit |"
echo "|---|---|---|"
while IFS='|' read -r name want envs cmd; do
  # shellcheck disable=SC2086
  eval timeout 300 env $envs "$bin" $cmd >/dev/null 2>"$work/fault.err" </dev/null
  code=$?
  echo "| $name | $want | $code |"
  if [ "$code" != "$want" ]; then
    echo "soak: fault '$name' exited $code, not $want: $(tail -n1 "$work/fault.err")" >&2
    bad=1
  fi
done <<EOF_FAULTS
--out a device (/dev/null)|2|SOAK=1|probe $tiny --out /dev/null
--out a FIFO|2|SOAK=1|probe $tiny --out $work/fifo
--out a symlink to stdout|2|SOAK=1|probe $tiny --out $work/stdout-link
--out in a missing folder|2|SOAK=1|probe $tiny --out $work/missing/run.json
a 17 MiB config.json|2|SOAK=1|estimate --config $work/huge.json
verify_failed at every probe of one value|0|OOMPROBE_TEST_VERIFY_FAIL_AT=40|probe $tiny --json
a pickle nested 2e5 deep (estimate)|2|SOAK=1|estimate --snapshot $work/nested.pickle
a pickle nested 2e5 deep (diagnose)|2|SOAK=1|diagnose --snapshot $work/nested.pickle
a pickle nested 2e5 deep (probe)|2|SOAK=1|probe --snapshot $work/nested.pickle --budget 64MiB
trace sizes of 2^62|2|SOAK=1|probe --snapshot $work/huge-sizes.pickle --budget 64MiB
/dev/zero as --snapshot|2|SOAK=1|estimate --snapshot /dev/zero
/dev/zero to compare|2|SOAK=1|compare /dev/zero
a FIFO with no writer as --config|2|SOAK=1|estimate --config $work/fifo
a snapshot made by _profile_to_snapshot|0|SOAK=1|estimate --snapshot $profiled
gemma2 with --attention sdpa|2|SOAK=1|estimate --model gemma2-9b --attention sdpa
EOF_FAULTS
echo

results="$work/results.tsv" # case limit value outcome exit seconds detail
searches="$work/searches.tsv"
: >"$results"
: >"$searches"

for limit in $limits; do
  for c in $cases; do
    # shellcheck disable=SC2046
    args=$(case_args "$c")
    out="$work/search.json"
    start=$(date +%s.%N)
    # shellcheck disable=SC2086
    prlimit --as="$limit" "$bin" probe $args --quiet --json --timeout "$timeout" >"$out" 2>"$work/search.err"
    code=$?
    secs=$(python3 -c "import time; print(f'{time.time()-$start:.0f}')")
    max_fit=$(json_field "$out" 'r["runs"][0]["max_fit"]')
    reason=$(json_field "$out" 'r["runs"][0]["fail_reason"]')
    step=$([ "$c" = params ] && echo 65536 || echo 1)
    # --repeat (2 by default on real OOM): how often max_fit and first_fail fit again.
    repeat=$(json_field "$out" '" ".join("%d:%d/%d" % (x["value"], x["fits"], x["tries"]) for x in r["runs"][0].get("repeats", [])) or "-"')
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$c" "$limit" "${max_fit:-none}" "${reason:-none}" "$code" "$secs" "${repeat:--}" >>"$searches"
    if [ -n "$max_fit" ] && [ "$max_fit" != None ] && [ "$code" != 0 ]; then
      echo "soak: $c under $limit found max_fit $max_fit and exited $code" >&2
      bad=1
    fi
    if [ -z "$max_fit" ] || [ "$max_fit" = None ]; then
      echo "soak: $c under $limit: no boundary (exit $code): $(tail -n1 "$work/search.err")" >&2
      [ "$code" = 0 ] || bad=1
      continue
    fi
    for i in $(seq 0 $((per_case - 1))); do
      x=$((max_fit + i * step))
      p="$work/probe.json"
      t0=$(date +%s.%N)
      # shellcheck disable=SC2086
      prlimit --as="$limit" "$bin" probe $args --at "$x" --quiet --json --timeout "$timeout" >"$p" 2>"$work/probe.err"
      pc=$?
      ps=$(python3 -c "import time; print(f'{time.time()-$t0:.1f}')")
      outcome=$(json_field "$p" 'r["runs"][0]["probes"][-1]["outcome"]')
      detail=$(json_field "$p" '(r["runs"][0]["probes"][-1].get("detail") or "").replace("\t"," ")[:100]')
      outcome=${outcome:-no_output}
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$c" "$limit" "$x" "$outcome" "$pc" "$ps" "$detail" >>"$results"
      want=0
      [ "$outcome" = error ] && want=1
      if [ "$outcome" = error ] || [ "$outcome" = timeout ] || [ "$outcome" = no_output ] \
        || [ "$pc" != "$want" ] || grep -q "panicked" "$work/probe.err"; then
        echo "soak: $c under $limit at $x: $outcome, exit $pc: $detail $(tail -n1 "$work/probe.err")" >&2
        bad=1
      fi
    done
  done
done

python3 - "$results" "$searches" <<'PY'
import collections, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
searches = [l.rstrip("\n").split("\t") for l in open(sys.argv[2]) if l.strip()]
outcomes = ["fit", "out_of_memory", "crashed", "killed", "timeout", "error", "no_output"]
by = collections.defaultdict(collections.Counter)
for c, limit, x, o, code, secs, *detail in rows:
    by[(c, int(limit))][o] += 1
print(f"edge probes: {len(rows)}")
print("| case | as limit | " + " | ".join(outcomes) + " |")
print("|---|---|" + "---|" * len(outcomes))
total = collections.Counter()
for (c, limit), n in sorted(by.items()):
    total.update(n)
    print(f"| {c} | {limit / 2**30:.1f} GiB | " + " | ".join(str(n[o]) for o in outcomes) + " |")
print("| all | | " + " | ".join(str(total[o]) for o in outcomes) + " |")
print()
print("| case | as limit | max fit | reason | exit | seconds | repeats (value:fits/tries) |")
print("|---|---|---|---|---|---|---|")
for c, limit, m, r, code, secs, rep in searches:
    print(f"| {c} | {int(limit) / 2**30:.1f} GiB | {m} | {r} | {code} | {secs} | {rep} |")
crashes = collections.Counter(r[6][:80] for r in rows if r[3] == "crashed" and len(r) > 6)
if crashes:
    print()
    print("crash causes:")
    for d, n in crashes.most_common():
        print(f"  {n} x {d}")
PY
exit $bad
