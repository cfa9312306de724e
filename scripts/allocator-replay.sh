#!/usr/bin/env bash
# Replay every real snapshot in a folder through the caching allocator model and print one
# TSV row per device (validation/allocator/replay.tsv was made with it):
#
#   scripts/allocator-replay.sh DIR [OOMPROBE]      (OOMPROBE default: target/debug/oomprobe)
#
# The files are the ones validation/allocator/GATHERED.md lists (repository, commit, path,
# licence); most are not committed (size or licence). Needs python3 for the JSON.
set -uo pipefail
dir=${1:?usage: scripts/allocator-replay.sh DIR [OOMPROBE]}
exe=${2:-target/debug/oomprobe}
printf 'file\tdevice\tblocks_total\tblocks_matched\tsegment_events_total\tsegment_events_matched\treserved_peak_recorded\treserved_peak_replayed\tsettings_or_note\n'
for f in "$dir"/*.pickle; do
  "$exe" estimate --snapshot "$f" --snapshot-device all --json 2>/dev/null |
    python3 -c '
import json, sys
name = sys.argv[1]
try:
    d = json.load(sys.stdin)
except Exception:
    print(f"{name}\t-\t\t\t\t\t\t\tnot read"); sys.exit()
notes = " ".join(d.get("notes", []) + [n for v in d.get("devices", []) for n in v.get("notes", [])])
for v in d.get("devices", []):
    dev = v.get("device", "?")
    r = v.get("allocator_replay")
    if r:
        cols = [r[k] for k in ("blocks_total", "blocks_matched", "segment_events_total",
                "segment_events_matched", "reserved_peak_recorded", "reserved_peak_replayed")]
        print("\t".join([name, f"cuda:{dev}"] + [str(c) for c in cols] + [r["settings"]]))
    else:
        why = [n.split("allocator replay not run: ", 1)[1] for n in notes
               if f"cuda:{dev}: allocator replay not run" in n]
        print("\t".join([name, f"cuda:{dev}"] + [""] * 6 + [why[0] if why else "no alloc/free trace"]))
' "$(basename "$f")"
done
