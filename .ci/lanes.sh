#!/usr/bin/env bash
# The test runs of `make test`, in two lanes at once: the machine has two
# cores and each pytest process mostly uses one. Lane 1: the full suite on
# TensorFlow, then the tests marked `backends` on TensorFlow with
# keras-nightly. Lane 2: the tests marked `backends` on each other backend,
# then on TensorFlow with the oldest Keras (lane 1 about 27 min, lane 2
# about 25 min on a clean clone; the nightly moved to lane 1 when lane 2
# grew past 28). Every
# run goes on even if an earlier one failed; each run's output is printed
# whole, in this order, once all are done. Exits 1 if any run failed.
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
    env "${env[@]}" "$py" -m pytest -q "$@" >> "$logs/$name.log" 2>&1
    echo $? > "$logs/$name.rc"
}

version() { PYTHONPATH=$1 KERAS_BACKEND=numpy "$py" -c 'import keras; print(keras.version())' 2>/dev/null; }

names=(tensorflow)
(
    run tensorflow "KERAS_BACKEND=tensorflow: full suite" KERAS_BACKEND=tensorflow --
    # keras-hub 0.32 imports a name keras-nightly moved: its tests run on
    # released Kerases only (the other keras_hub tests skip themselves).
    run nightly "Keras $(version "$nightly") (keras-nightly), tensorflow: tests marked 'backends'" \
        PYTHONPATH="$nightly" KERAS_BACKEND=tensorflow -- "${marked[@]}" --ignore tests/test_keras_hub.py
) &
(
    for b in "$@"; do
        run "$b" "KERAS_BACKEND=$b: tests marked 'backends'" KERAS_BACKEND="$b" -- "${marked[@]}"
    done
    run oldest "Keras $(version "$oldest"), tensorflow: tests marked 'backends'" \
        PYTHONPATH="$oldest" KERAS_BACKEND=tensorflow -- "${marked[@]}" --ignore tests/test_keras_hub.py
) &
wait
names+=("$@" oldest nightly)
status=0
for name in "${names[@]}"; do
    cat "$logs/$name.log"
    [ "$(cat "$logs/$name.rc")" = 0 ] || status=1
done
rm -rf "$logs"
exit $status
