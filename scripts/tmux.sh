#!/usr/bin/env bash
# Run `rl` in a tmux session: one pane for the launcher, one tailing each process's log.
#
#   scripts/tmux.sh [-s SESSION] [-d] OUTPUT_DIR [rl arguments ...]
#
# -d starts the session detached (attach later with `tmux attach -t SESSION`).
set -euo pipefail
cd "$(dirname "$0")/.."

session=rl
detach=0
while getopts "s:d" opt; do
  case "$opt" in
    s) session="$OPTARG" ;;
    d) detach=1 ;;
    *) echo "usage: $0 [-s SESSION] [-d] OUTPUT_DIR [rl arguments ...]" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { echo "usage: $0 [-s SESSION] [-d] OUTPUT_DIR [rl arguments ...]" >&2; exit 2; }
out="$1"; shift
command -v tmux >/dev/null || { echo "tmux is not installed (apt-get install tmux)" >&2; exit 1; }
if tmux has-session -t "$session" 2>/dev/null; then
  echo "tmux session '$session' already exists: attach with 'tmux attach -t $session' or pass -s NAME" >&2
  exit 1
fi

mkdir -p "$out/logs"
launcher="uv run rl $(printf '%q ' "$@")--output-dir $(printf '%q' "$out"); echo; echo '[rl exited: press enter]'; read"
tail_log() { echo "touch $(printf '%q' "$out/logs/$1.log"); tail -F -n 200 $(printf '%q' "$out/logs/$1.log")"; }

# Left column: launcher above inference; right column: trainer above orchestrator.
launcher_pane=$(tmux new-session -d -s "$session" -n rl -x 240 -y 60 -P -F '#{pane_id}' "$launcher")
trainer_pane=$(tmux split-window -t "$launcher_pane" -h -P -F '#{pane_id}' "$(tail_log trainer)")
inference_pane=$(tmux split-window -t "$launcher_pane" -v -P -F '#{pane_id}' "$(tail_log inference)")
orchestrator_pane=$(tmux split-window -t "$trainer_pane" -v -P -F '#{pane_id}' "$(tail_log orchestrator)")
for name in launcher trainer inference orchestrator; do
  pane_var="${name}_pane"
  tmux select-pane -t "${!pane_var}" -T "$name"
done
tmux select-pane -t "$launcher_pane"
tmux set-option -t "$session" pane-border-status top >/dev/null
[ "$detach" = 1 ] || tmux attach -t "$session"
