#!/usr/bin/env bash
# Issue 31 item 4: each recipe lever against the same baseline, one after another over the same cached data
# (the data stages run once under --root; every lever trains and serves its own draft). n=500 chats, 9 epochs, Muon,
# train.select=best, as the README's recipe; speculators' side by side stays in benchmarks/results/quality-*.txt.
#   benchmarks/levers.sh [root] [log]     # ~3 h on 2 quiet cores; each lever's JSON row is one line of the log
set -u
root=${1:-runs/quality}
log=${2:-levers.log}
py=${PYTHON:-.venv/bin/python}
common=(--samples 500 --epochs 9 --optimizer muon --no-speculators --root "$root")
run() {
  local name=$1; shift
  echo "## $name: benchmarks/quality.py ${common[*]} $*  ($(date -u +%H:%M) UTC)" >> "$log"
  "$py" benchmarks/quality.py "${common[@]}" "$@" 2>&1 | grep -E '^\{|^ +[0-9]+ ' >> "$log"
}
run "EAGLE 3.1 (fc_norm + norm_output)" --eagle-3-1
run "position-weighted loss (decay 0.8)" --ttt-loss-decay 0.8
run "baseline (the README's recipe)"
run "deeper TTT with more epochs (5 steps, 12 epochs)" --ttt-steps 5 --epochs 12
run "more epochs alone (TTT 3, 12 epochs): the control of the row above" --epochs 12
run "data mixing: the corpus's own answers to the same prompts beside the target's (a second source)" --mix-original
run "more epochs (15): the same steps as the data-mixing row, its control" --epochs 15
run "more epochs (20)" --epochs 20
echo "## done $(date -u +%H:%M) UTC" >> "$log"
