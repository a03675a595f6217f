#!/usr/bin/env bash
# The test runs of `make test`, in two lanes at once: the machine has two
# cores and each pytest process mostly uses one. Lane 1: the full suite on
# TensorFlow, then the tests marked `backends` on each other backend but
# the first (PyTorch). Lane 2: those tests on the first other backend
# (JAX), then on TensorFlow with the oldest Keras and with keras-nightly.
# On a clean clone, 2026-12-07 (7ca150c): TF 24:08 + torch 3:29 (27:37)
# against JAX 20:16 + Keras 3.15.0 6:18 + nightly 5:20 (31:54). Every
# run goes on even if an earlier one failed; each run's output is printed
# whole, in this order, once all are done, its ten slowest tests at the
# end (what to mark slow when a lane grows). Exits 1 if any run failed.
#
# Usage: .ci/lanes.sh PYTHON OLDEST_DIR NIGHTLY_DIR BACKEND...
set -u
py=$1 oldest=$2 nightly=$3
shift 3
logs=$(mktemp -d)
marked=(-m "backends and not slow")

run() {  # run NAME TITLE ENV... -- ARGS...
    local name=$1 title=$2
    shift 2
    local env=()
    while [ "$1" != "--" ]; do env+=("$1"); shift; done
    shift
    echo "== $title ==" > "$logs/$name.log"
    env "${env[@]}" "$py" -m pytest -q --durations=10 "$@" >> "$logs/$name.log" 2>&1
    echo $? > "$logs/$name.rc"
}

version() { PYTHONPATH=$1 KERAS_BACKEND=numpy "$py" -c 'import keras; print(keras.version())' 2>/dev/null; }

names=(tensorflow)
first=${1:-}
[ $# -gt 0 ] && shift
(
    run tensorflow "KERAS_BACKEND=tensorflow: full suite" KERAS_BACKEND=tensorflow --
    for b in "$@"; do
        run "$b" "KERAS_BACKEND=$b: tests marked 'backends'" KERAS_BACKEND="$b" -- "${marked[@]}"
    done
) &
(
    if [ -n "$first" ]; then
        run "$first" "KERAS_BACKEND=$first: tests marked 'backends'" KERAS_BACKEND="$first" -- "${marked[@]}"
    fi
    run oldest "Keras $(version "$oldest"), tensorflow: tests marked 'backends'" \
        PYTHONPATH="$oldest" KERAS_BACKEND=tensorflow -- "${marked[@]}" --ignore tests/test_keras_hub.py
    # keras-hub 0.32 imports a name keras-nightly moved: its tests run on
    # released Kerases only (the other keras_hub tests skip themselves).
    run nightly "Keras $(version "$nightly") (keras-nightly), tensorflow: tests marked 'backends'" \
        PYTHONPATH="$nightly" KERAS_BACKEND=tensorflow -- "${marked[@]}" --ignore tests/test_keras_hub.py
) &
wait
[ -n "$first" ] && names+=("$first")
names+=("$@" oldest nightly)
status=0
for name in "${names[@]}"; do
    cat "$logs/$name.log"
    [ "$(cat "$logs/$name.rc")" = 0 ] || status=1
done
rm -rf "$logs"
exit $status
