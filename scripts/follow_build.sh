# Sourced by scripts/run.sh (the editable install) and scripts/build_wheel.sh (the binary wheel).
# follow_build WHAT LOG T0 COMMAND...: runs COMMAND with its output into LOG and, while it runs,
# shows which part is configured, compiled or linked (and any error) with the seconds since T0;
# when it fails, the last lines of LOG and status 1.
follow_build() {
  local what="$1" log="$2" t0="$3"; shift 3
  "$@" > "$log" 2>&1 &
  local pid=$!
  tail -n +1 -f --pid="$pid" "$log" | while IFS= read -r line; do
    case "$line" in
      *"] Building "*|*"] Linking "*|*"CMake Error"*|*" error: "*|*"ep_comm: "*)
        printf '   %4d s  %s\n' $((SECONDS - t0)) "${line##*] }" ;;
    esac
  done
  if ! wait "$pid"; then
    echo "FAILED: $what (the last lines of $log):"
    tail -30 "$log"
    return 1
  fi
}
