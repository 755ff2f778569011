#!/usr/bin/env bash
# lm-evaluation-harness's `local-completions` against `graphguard serve`, offline: starts the
# server (the embedded SmolLM2-135M-Instruct unless arguments choose a model) on a free
# loopback port, runs the two local tasks in bench/lm_eval_tasks with lm-eval's default
# tokenizer settings (its remote tokenizer: the server's /tokenizer_info and /tokenize), prints
# the results table and the server's request counts, and stops the server. It fails when a
# request got anything but a 200, or when lm-eval did not tokenize through the server.
#
#   LM_EVAL=/tmp/lmeval-venv/bin/lm_eval bench/lm_eval_offline.sh [graphguard serve args]
#
# LM_EVAL: the lm_eval executable (lm-eval is not a dependency; `pip install "lm-eval[api]"`
# in a venv of its own). LM_EVAL_MODEL_ARGS: extra model_args, appended after a comma (e.g.
# `num_concurrent=4`). LM_EVAL_ARGS: extra lm_eval arguments, split at spaces (e.g.
# `--batch_size 4`: lm-eval refuses `batch_size` in model_args, as its CLI always passes one).
# LM_EVAL_TASKS: default both tasks. Arguments go to `graphguard serve` (the repository's
# .venv, as tools/setup makes it); without --model, --device, --dtype or --kernels on a machine
# without CUDA it serves with `--kernels q4`, as tools/serve does.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
lm_eval=${LM_EVAL:-lm_eval}
tasks=${LM_EVAL_TASKS:-graphguard_simple_mc,graphguard_simple_gen}
read -ra extra_args <<<"${LM_EVAL_ARGS:-}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

defaults=()
if ! printf '%s\n' "$@" | grep -qE '^--(model|device|dtype|kernels)(=|$)' &&
  ! .venv/bin/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  defaults=(--kernels q4)
fi
port=$(.venv/bin/python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp -t graphguard-lm-eval.XXXXXX.log)
# Log level info: the access log lines show which endpoints lm-eval called.
.venv/bin/graphguard serve ${defaults[@]+"${defaults[@]}"} --port "$port" --log-level info "$@" \
  >"$log" 2>&1 &
server=$!
trap 'kill -INT "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT

url=http://127.0.0.1:$port
until curl -fsS "$url/health" >/dev/null 2>&1; do
  kill -0 "$server" 2>/dev/null || { cat "$log"; echo "graphguard serve exited" >&2; exit 1; }
  ((SECONDS < 600)) || { echo "graphguard serve not healthy after 600 s" >&2; exit 1; }
  sleep 0.5
done
model=$(curl -fsS "$url/v1/models" | .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
echo "server: $url, model $model, log $log"

model_args=model=$model,base_url=$url/v1/completions${LM_EVAL_MODEL_ARGS:+,$LM_EVAL_MODEL_ARGS}
# The tasks' data_files are relative to the working directory: run lm-eval beside them.
started=$(date +%s.%N)
(cd "$repo/bench/lm_eval_tasks" &&
  "$lm_eval" run --model local-completions --tasks "$tasks" --include_path . \
    --model_args "$model_args" ${extra_args[@]+"${extra_args[@]}"})
ended=$(date +%s.%N)

echo "lm_eval wall time: $(.venv/bin/python -c "print(round($ended - $started, 1))") s"
echo "server requests by endpoint and status:"
requests=$(grep -oE '"(GET|POST) [^ ]+ HTTP/1.1" [0-9]{3}' "$log" | sort | uniq -c)
echo "$requests"
# A failed request, or prompts not tokenized by the server, fails the check.
if grep -qvE ' 200$' <<<"$requests"; then
  echo "requests failed; server log: $log" >&2
  exit 1
fi
# lm-eval's support probe tokenizes once; its remote tokenizer makes the rest of the calls.
tokenized=$(grep -E 'POST /tokenize ' <<<"$requests" | awk '{print $1}' || true)
((${tokenized:-0} > 1)) || { echo "lm-eval did not tokenize through /tokenize" >&2; exit 1; }
