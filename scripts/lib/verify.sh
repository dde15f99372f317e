#!/usr/bin/env bash
# Smoke test of what scripts/setup installed (run by `scripts/setup --verify`).
# Talks only to 127.0.0.1. Starts llama-server on the tiny model, checks token
# ids in logprobs (plain and streamed), that /apply-template + /tokenize
# reproduce usage.prompt_tokens, then runs Pi and Qwen Code against it; then the tiny
# tool-calling model: a tool call when tools are offered, `Done.` once a result is there.
# The server and every temp dir are removed on exit.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/common.sh"
CACHE="${TOKENTAP_CACHE:-$HOME/.cache/tokentap}"
. "$CACHE/env.sh"
PORT="${TOKENTAP_VERIFY_PORT:-18999}"
URL="http://127.0.0.1:$PORT"
TMP="$(mktemp -d)"
SERVER_PID=""
TOOLS_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  if [ -n "$TOOLS_PID" ]; then kill "$TOOLS_PID" 2>/dev/null || true; wait "$TOOLS_PID" 2>/dev/null || true; fi
  rm -rf "$TMP"
}
trap cleanup EXIT
fail=0
check() { if eval "$2"; then say "PASS $1"; else say "FAIL $1"; fail=1; fi; }

start_server() {
  "$TOKENTAP_LLAMA_SERVER" -m "$TOKENTAP_MODEL_TINY" --host 127.0.0.1 --port "$PORT" \
    -c 32768 -np 1 -a tiny --jinja >"$TMP/server.log" 2>&1 &
  SERVER_PID=$!
  local i
  for i in $(seq 1 100); do
    curl -fs "$URL/health" >/dev/null 2>&1 && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$TMP/server.log" >&2; die "llama-server exited"; }
    sleep 0.2
  done
  die "llama-server did not become healthy"
}

post() { curl -fsS "$URL$1" -H 'content-type: application/json' -d "$2"; }

MSGS='[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hello and name one file."}]'

check_chat() {
  local i r n stops=0 ids=1 lens=""
  for i in 1 2 3 4 5; do
    r="$(post /v1/chat/completions "{\"messages\":$MSGS,\"logprobs\":true,\"top_logprobs\":1,\"max_tokens\":2000,\"temperature\":0.8}")"
    [ "$(jq -r '.choices[0].finish_reason' <<<"$r")" = stop ] && stops=$((stops + 1))
    jq -e '.choices[0].logprobs.content | length > 0 and all(.id | type == "number")' <<<"$r" >/dev/null || ids=0
    n="$(jq '.usage.completion_tokens' <<<"$r")"; lens="$lens $n"
  done
  say "temperature 0.8: completion_tokens:$lens"
  check "chat ends by itself (finish_reason stop, 5/5)" "[ $stops = 5 ]"
  check "chat logprobs carry token ids" "[ $ids = 1 ]"
  r="$(post /v1/chat/completions "{\"messages\":$MSGS,\"max_tokens\":300,\"temperature\":0}")"
  say "temperature 0: finish_reason $(jq -r '.choices[0].finish_reason' <<<"$r"), $(jq '.usage.completion_tokens' <<<"$r") tokens"
}

check_stream() {
  post /v1/chat/completions "{\"messages\":$MSGS,\"stream\":true,\"logprobs\":true,\"top_logprobs\":1,\"max_tokens\":2000,\"temperature\":0.8}" \
    | sed -n 's/^data: //p' | grep -v '^\[DONE\]' >"$TMP/chunks.jsonl"
  check "stream chunks carry logprobs ids" \
    "jq -se '[.[] | .choices[0].logprobs.content[]?.id] | length > 0 and all(type == \"number\")' '$TMP/chunks.jsonl' >/dev/null"
}

check_prompt_ids() {
  local prompt n_tok n_usage
  prompt="$(post /apply-template "{\"messages\":$MSGS}" | jq -c .prompt)"
  n_tok="$(post /tokenize "{\"content\":$prompt,\"add_special\":true,\"parse_special\":true}" | jq '.tokens | length')"
  n_usage="$(post /v1/chat/completions "{\"messages\":$MSGS,\"max_tokens\":1}" | jq .usage.prompt_tokens)"
  check "apply-template+tokenize = usage.prompt_tokens ($n_tok vs $n_usage)" "[ '$n_tok' = '$n_usage' ]"
}

run_timed() { # run_timed LABEL CMD...: runs with a timeout, reports exit code and seconds
  local label=$1 t0 ms rc=0; shift
  t0=${EPOCHREALTIME/./}
  timeout 120 "$@" </dev/null >"$TMP/$label.out" 2>"$TMP/$label.err" || rc=$?
  ms=$(( (${EPOCHREALTIME/./} - t0) / 1000 ))
  say "$label: exit $rc in ${ms} ms; output: $(head -c 120 "$TMP/$label.out" | tr '\n' ' ')"
  [ "$rc" = 0 ] || { tail -5 "$TMP/$label.err" >&2; }
  return "$rc"
}

check_pi() {
  local home="$TMP/pi-home"
  mkdir -p "$home/.pi/agent"
  cat >"$home/.pi/agent/models.json" <<EOF
{"providers":{"x":{"baseUrl":"$URL/v1","api":"openai-completions","apiKey":"k",
  "compat":{"supportsDeveloperRole":false,"supportsReasoningEffort":false},
  "models":[{"id":"tiny","contextWindow":32768,"maxTokens":4096}]}}}
EOF
  check "pi -p against the tiny model" "(cd '$TMP' && run_timed pi env HOME='$home' pi -p --provider x --model tiny 'say hi')"
}

check_qwen() {
  # `setup --only pi` (the demo's) installs Pi alone.
  if ! command -v qwen >/dev/null 2>&1; then say "skip qwen (not installed: setup's harnesses step)"; return; fi
  local home="$TMP/qwen-home"
  mkdir -p "$home/.qwen"
  echo '{"privacy":{"usageStatisticsEnabled":false},"memory":{"enableManagedAutoMemory":false,"enableManagedAutoDream":false}}' \
    >"$home/.qwen/settings.json"
  check "qwen --auth-type openai against the tiny model" \
    "(cd '$TMP' && run_timed qwen env HOME='$home' OPENAI_BASE_URL='$URL/v1' OPENAI_API_KEY=k OPENAI_MODEL=tiny qwen --auth-type openai 'say hi')"
}

check_tool_model() {
  local model="${TOKENTAP_MODEL_TINY_TOOLS:-$CACHE/models/tiny-qwen3-tools.gguf}" url="http://127.0.0.1:$((PORT + 1))" i r
  [ -f "$model" ] || { say "FAIL tool model missing: $model (setup's models step)"; fail=1; return; }
  "$TOKENTAP_LLAMA_SERVER" -m "$model" --host 127.0.0.1 --port "$((PORT + 1))" \
    -c 40960 -np 1 -a tiny-tools --jinja >"$TMP/tools-server.log" 2>&1 &
  TOOLS_PID=$!
  for i in $(seq 1 100); do curl -fs "$url/health" >/dev/null 2>&1 && break; sleep 0.2; done
  local tools='[{"type":"function","function":{"name":"bash","parameters":{"type":"object","properties":{"command":{"type":"string"}},"required":["command"]}}}]'
  local user='{"role":"user","content":"Where am I?"}'
  r="$(curl -fsS "$url/v1/chat/completions" -d "{\"messages\":[$user],\"tools\":$tools,\"temperature\":1}")"
  check "tool model calls bash with pwd" \
    "jq -e '.choices[0].finish_reason == \"tool_calls\" and .choices[0].message.tool_calls[0].function.name == \"bash\" and (.choices[0].message.tool_calls[0].function.arguments | fromjson) == {\"command\":\"pwd\"}' <<<'$r' >/dev/null"
  r="$(curl -fsS "$url/v1/chat/completions" -d "{\"messages\":[$user,{\"role\":\"assistant\",\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\",\"function\":{\"name\":\"bash\",\"arguments\":\"{\\\"command\\\": \\\"pwd\\\"}\"}}]},{\"role\":\"tool\",\"tool_call_id\":\"c\",\"content\":\"/tmp\"}],\"tools\":$tools,\"temperature\":1}")"
  check "tool model answers Done. after the result" \
    "jq -e '.choices[0].finish_reason == \"stop\" and .choices[0].message.content == \"Done.\"' <<<'$r' >/dev/null"
}

start_server
check_chat
check_stream
check_prompt_ids
check_pi
check_qwen
check_tool_model
[ "$fail" = 0 ] && say "verify: all checks passed" || die "verify: some checks failed"
