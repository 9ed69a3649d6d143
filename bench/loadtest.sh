#!/usr/bin/env bash
# Load test of an OpenAI-compatible server with plain curl: REQUESTS completions (default 100)
# at a fixed CONCURRENCY (default 8). Prints one "key: value" line per result: successes
# (HTTP 200), failures (the rest, including requests not done by the deadline), requests/s
# and the latency percentiles of the successes.
#
# usage: bench/loadtest.sh URL [REQUESTS] [CONCURRENCY]
#   URL          the server root, e.g. http://127.0.0.1:8000; nothing else is contacted
#   MODEL        model name (default: the first of URL/v1/models)
#   MAX_TOKENS   tokens per completion (default 32)
#   MAX_TIME     seconds allowed per request (default 120)
#   DEADLINE     seconds allowed for the whole test (default 600)
#   API_KEY      sent as "Authorization: Bearer API_KEY" when set
# Exit status: 0 when every request succeeded, 1 when some failed, 2 on bad usage.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 3 ]]; then
  echo "usage: $0 URL [REQUESTS] [CONCURRENCY]" >&2
  exit 2
fi
url=${1%/}
url=${url%/v1}
requests=${2:-100}
concurrency=${3:-8}
max_tokens=${MAX_TOKENS:-32}
max_time=${MAX_TIME:-120}
deadline=${DEADLINE:-600}
for name in requests concurrency max_tokens max_time deadline; do
  if [[ ! ${!name} =~ ^[1-9][0-9]*$ ]]; then
    echo "$0: $name must be a positive integer, got '${!name}'" >&2
    exit 2
  fi
done

api_curl() {
  if [[ -n ${API_KEY:-} ]]; then
    curl -H "Authorization: Bearer $API_KEY" "$@"
  else
    curl "$@"
  fi
}

# One completion; prints "HTTP-status total-seconds" (status 000 when no reply came).
fire() {
  local prompt="Load test request $1: write a short story about a lighthouse keeper."
  local body="{\"model\": \"$model\", \"prompt\": \"$prompt\", \"max_tokens\": $max_tokens}"
  api_curl -sS -o /dev/null --max-time "$max_time" -w '%{http_code} %{time_total}\n' \
    -H 'Content-Type: application/json' -d "$body" "$url/v1/completions" 2>/dev/null || true
}

model=${MODEL:-}
if [[ -z $model ]]; then
  if ! models=$(api_curl -fsS --max-time 10 "$url/v1/models"); then
    echo "$0: cannot list the models at $url/v1/models" >&2
    exit 2
  fi
  model=$(grep -o '"id" *: *"[^"]*"' <<<"$models" | head -n 1 | sed 's/.*"\([^"]*\)"$/\1/')
  if [[ -z $model ]]; then
    echo "$0: no model listed at $url/v1/models; set MODEL" >&2
    exit 2
  fi
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export url model max_tokens max_time API_KEY=${API_KEY:-}
export -f api_curl fire

start=$(date +%s.%N)
# timeout ends the whole process group on the deadline: xargs and the curls in flight.
# shellcheck disable=SC2016  # $1 is expanded by the child shell, as meant
seq 1 "$requests" \
  | timeout "$deadline" xargs -P "$concurrency" -I {} bash -c 'fire "$1"' _ {} \
    >"$work/results" || true
end=$(date +%s.%N)

awk '$1 == 200 { print $2 }' "$work/results" | sort -n >"$work/latencies"
successes=$(wc -l <"$work/latencies")
failures=$((requests - successes))
awk -v url="$url" -v model="$model" -v requests="$requests" -v concurrency="$concurrency" \
  -v successes="$successes" -v failures="$failures" -v start="$start" -v end="$end" '
  { latency[NR] = $1 }
  function percentile(p,    rank) {  # nearest rank over the sorted latencies
    if (NR == 0) return "nan"
    rank = int(p * NR / 100)
    if (rank < p * NR / 100) rank++
    return sprintf("%.3f", latency[rank < 1 ? 1 : rank])
  }
  END {
    elapsed = end - start
    print "url: " url
    print "model: " model
    print "requests: " requests
    print "concurrency: " concurrency
    print "successes: " successes
    print "failures: " failures
    printf "elapsed_s: %.3f\n", elapsed
    printf "requests_per_s: %.2f\n", successes / elapsed
    print "latency_p50_s: " percentile(50)
    print "latency_p90_s: " percentile(90)
    print "latency_p99_s: " percentile(99)
  }' "$work/latencies"
[[ $failures -eq 0 ]] || exit 1
